# from a folder holding clean_calls.py and the tree laid out under site/
export PYTHONPATH=$PWD/site
FTT_EFTA_CONFIG=128,64,8,3 timeout 100 python3 clean_calls.py 40 prefill 2>&1 | grep -v Warn | tee $OUT/prefill.txt
FTT_EFTA_CONFIG=16,64,4,3 timeout 60 python3 clean_calls.py 40 decode 2>&1 | grep -v Warn | tee $OUT/decode.txt
