set -x
for i in 1 2; do
  for side in old new; do
    if [ $side = old ]; then dir=/tmp/old; else dir=/work/main; fi
    (cd $dir && python benchmarks/serve_sweep.py --profile benchmarks/results/serving/profile_cpu_epyc_v29_1thread.json --temperatures 1 --concurrency 16 64 --requests-per-client 6 --length-spread 0.5 --repeats 1 --arms none dspark --port 8300 --out /tmp/exp/seg/oldnew_${side}_$i) 2>&1 | grep "tok/s" | grep "r=0"
  done
done
