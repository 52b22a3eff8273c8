# attn.acc and attn.kv_cache again (same seeds as the all-site campaign), with esc_impl: SPEC §7 tolerance over three implementations
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
run() {
  timeout 170 python3 scripts/efta_coverage.py --device cuda --dtype $1 --shape 2,8,2,128,512,64 \
    --classes sign,exponent,mantissa --no-progress --n 1000 --clean-calls 0 --sites attn.acc,attn.kv_cache \
    --json $OUT/$1.json --csv $OUT/$1.csv > $OUT/$1.log 2>&1
  echo "$1 rc $?" >> $OUT/rc.txt
}
run float16 & run bfloat16 &
wait
cat $OUT/rc.txt
for f in $OUT/*.log; do echo "== $f"; tail -n 14 $f | cut -c1-160; done
