#!/bin/bash
# gpu_check.py on a GPU machine lent by this workplace's device tool: a bare CUDA image with
# Python 3.12, torch, transformers (an older one), accelerate and peft, and no network.
#
#   bash benchmarks/gpu_lease.sh wheels   # here: .whl/ (git-ignored, ~60 MB) of what gpu_check
#                                         # imports beyond the image, at .venv's versions, cp312
#   device run, carry [".whl"], command:  bash benchmarks/gpu_lease.sh run
#     CHAT_S (360: gpu_check --shape chat, alignflow and TRL at chat shapes; 0 skips it), MAIN_S (240),
#     STEPS (20), SHARDINGS ("" by default; "fsdp zero3" for both), SHARD_S (240): its knobs
#
# The logs land in $OUT (chat.log, main.log, fsdp.log, zero3.log, env.txt). benchmarks/README.md, "`gpu_check.py`:
# the whole pipeline's code on one GPU", has the figures of the last lease and what each part took.
set -o pipefail

# Imported by gpu_check and its sharded checks and not in the image (or there in another version):
# read off sys.modules after a CPU smoke run, 2026-12-06. torch, numpy, pandas, pyarrow, scipy and
# the other large ones are the image's own.
CARRIED="accelerate amplitude-analytics annotated-doc annotated-types anyio asgi-lifespan attrs cachetools
certifi charset-normalizer click cloudpickle colorama coolname databricks-sdk datasets dill exceptiongroup
fastapi filelock fsspec google-auth griffecli griffelib h11 h2 hpack httpcore httpcore2 httpx httpx2
huggingface_hub humanize hyperframe idna importlib_metadata jsonpointer jsonschema jsonschema-specifications
kernels mlflow mlflow-skinny mlflow-tracing multiprocess opentelemetry-api opentelemetry-proto opentelemetry-sdk
opentelemetry-semantic-conventions orjson packaging pathspec peft pendulum prefect prometheus_client protobuf
pydantic pydantic-extra-types pydantic-settings pydantic_core python-dateutil python-dotenv python-slugify pytz
referencing requests rfc3339-validator rich rpds-py six sniffio sqlparse starlette tokenizers toml tqdm
transformers truststore typing-inspection typing_extensions tzdata urllib3 websockets xxhash zipp"
DEEPSPEED=0.19.8  # for --sharding zero3; PyPI has its source only: built here, without its ops

wheels() {
  local platforms=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  rm -rf .whl && mkdir .whl
  # shellcheck disable=SC2086
  .venv/bin/python -c 'import sys, importlib.metadata as m; print("\n".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' \
    $CARRIED > .whl/requirements.txt || exit 1
  echo hjson >> .whl/requirements.txt  # deepspeed's, not in the image
  echo trl==1.16.0 >> .whl/requirements.txt  # beside alignflow in --shape chat; a benchmark's, never the project's
  python3 -m pip download -q --no-deps --only-binary=:all: "${platforms[@]}" -d .whl -r .whl/requirements.txt || exit 1
  DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps -w .whl "deepspeed==$DEEPSPEED" || exit 1
  du -sh .whl
}

run() {
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  local start
  start=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 3; }
  export PYTHONPATH=/tmp/site:$PWD
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; lscpu | grep "Model name"
    python3 -c 'import sys, torch, transformers, datasets, accelerate, deepspeed
print(sys.version.split()[0], torch.__version__, transformers.__version__, datasets.__version__, accelerate.__version__,
      deepspeed.__version__)'; } 2>&1 | tee "$OUT/env.txt"
  if [ "${CHAT_S:-360}" -gt 0 ]; then
    timeout "${CHAT_S:-360}" python3 benchmarks/gpu_check.py --shape chat --steps 8 2>&1 | tee "$OUT/chat.log"
    echo "== chat rc=$? at $(($(date +%s) - start)) s"
  fi
  timeout "${MAIN_S:-240}" python3 benchmarks/gpu_check.py --steps "${STEPS:-20}" 2>&1 | tee "$OUT/main.log"
  echo "== main rc=$? at $(($(date +%s) - start)) s"
  for sharding in ${SHARDINGS-}; do
    timeout "${SHARD_S:-240}" python3 benchmarks/gpu_check.py --sharding "$sharding" --processes 1 --steps 4 2>&1 |
      tee "$OUT/$sharding.log"
    echo "== $sharding rc=$? at $(($(date +%s) - start)) s"
  done
}

case "$1" in
  wheels) wheels ;;
  run) run ;;
  *) echo "usage: $0 wheels|run" >&2; exit 2 ;;
esac
