# the EFTA coverage campaign, every site, fp16 and bf16 in parallel processes on one GPU (host-bound calls)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
S1=attn.scores,attn.masked_scores,attn.rowmax,attn.exponent
S2=attn.probs,attn.probs_lp,attn.alpha,attn.rowsum
S3=attn.acc,attn.rowmax_carry,attn.output,attn.checksum,attn.kv_cache
run() {  # dtype n clean sites name
  timeout 215 python3 scripts/efta_coverage.py --device cuda --dtype $1 --shape 2,8,2,128,512,64 \
    --classes sign,exponent,mantissa --no-progress --n $2 --clean-calls $3 ${4:+--sites $4} \
    --json $OUT/$5.json --csv $OUT/$5.csv > $OUT/$5.log 2>&1
  echo "$5 rc $?" >> $OUT/rc.txt
}
run float16 0 100000 "" fp16_clean &
run bfloat16 0 100000 "" bf16_clean &
for d in float16 bfloat16; do
  run $d 1000 0 $S1 ${d}_s1 & run $d 1000 0 $S2 ${d}_s2 & run $d 1000 0 $S3 ${d}_s3 &
done
wait
cat $OUT/rc.txt
for f in $OUT/*.log; do echo "== $f"; tail -n 18 $f | cut -c1-110; done
