# The TTFT bisect probe of "Where the first token's time went" (docs/lab/benchmarks.md): kept for
# the record; run from a checkout with the trees under .bisect/trees/<commit> (git archive).
# usage: bash .bisect/run.sh COMMIT... ; trees under .bisect/trees/<commit>; head is the checkout itself
set -x
source scripts/device_env.sh >/dev/null
CK=/tmp/ck7b
[ -d $CK ] || python3 -m hybridd.bench.random_checkpoint --preset ${PRESET:-llama2-7b} --out $CK > /dev/null
ROOT=$PWD
for spec in "$@"; do
  c=${spec%%:*}; extra=""; [ "$spec" != "$c" ] && extra=$(echo ${spec#*:} | tr '+' ' ')
  if [ "$c" = head ]; then dir=$ROOT; else dir=$ROOT/.bisect/trees/$c; ln -sfn $ROOT/hybridd/assets $dir/hybridd/assets 2>/dev/null; fi
  (cd $dir && PYTHONPATH=$dir:/tmp/site timeout 300 python3 $ROOT/docs/lab/bisect/probe.py $CK $OUT/bisect.jsonl $spec $extra) 2>&1 | tail -3
done
