# The Gluon checked-GEMM floor on one H200 (scripts/bench_gemm_gluon.py), one device call per file pair.
# All three ran with the worst-case bound τ·Σ|x|·max Σ|W| (the library's threshold came after them).
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1

# forms_fp16_h200.*: tile and persistent forms, levels 0-2, fp16 (the script just before ba8ace5; its level 1
# column measured the plain kernel: ptxas removed the unused checksum MMA)
python3 scripts/bench_gemm_gluon.py --out $OUT/gemm --dtypes float16 --rounds 3

# merged_h200.*: tile form, levels 0-3, fp16 and bf16 (ba8ace5)
python3 scripts/bench_gemm_gluon.py --out $OUT/gemm --dtypes float16,bfloat16 --forms tile --rounds 3

# library_h200.*: levels 0 and 3 beside the library's checked GEMM, fp16 and bf16 (24654c3: y without a row
# mask where BLOCK_M divides M, the three-stage 128 x 128 configs)
python3 scripts/bench_gemm_gluon.py --out $OUT/gemm --dtypes float16,bfloat16 --forms tile --levels 0,3 --library \
    --rounds 3
