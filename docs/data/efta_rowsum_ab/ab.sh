# from a folder holding ab.py and the two trees laid out under main_site/ (before) and site/ (after)
for r in 1 2; do for tree in main_site site; do PYTHONPATH=$PWD/$tree FTT_EFTA_CONFIG=128,64,8,3 timeout 40 python3 ab.py $tree 2>&1 | grep -v Warn | tee -a $OUT/ab.txt; done; done
