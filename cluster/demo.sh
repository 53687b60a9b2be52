#!/usr/bin/env bash
# `make demo`: start the local cluster (idempotent), submit the whole pipeline with
# `ray job submit`, follow its logs, then print the endpoint and a curl that works.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CONFIG="${CONFIG:-configs/digits.yaml}"
SUMMARY="$PWD/outputs/demo-summary.json"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

bash cluster/start.sh
mkdir -p outputs
rm -f "$SUMMARY"
echo "demo: submitting the pipeline for $CONFIG (logs follow)" >&2
.venv/bin/ray job submit --address "http://127.0.0.1:${RAYTORCH_DASHBOARD_PORT:-8265}" \
    --runtime-env cluster/runtime_env.yaml --working-dir . \
    -- python -m jobs.pipeline --config "$CONFIG" --summary-file "$SUMMARY"

.venv/bin/python - "$SUMMARY" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
sample = s["sample_request"]
print()
print(f"Endpoint:   {s['url']}  (Open Inference Protocol v2 + /v1 JSON)")
print(f"Model:      {s['stages']['deploy']['model']} version {s['stages']['deploy']['version']}")
print(f"Accuracy:   {s['stages']['evaluate']['metrics']['accuracy']:.4f} (held-out), "
      f"int8 {s['stages']['export']['report']['accuracy']['onnx_int8']:.4f}")
print(f"Sample:     predicted {sample['predicted']}, true {sample['expected']}")
print("Try it:")
print("  " + sample["curl"])
print(f"  curl -s {s['url']}/v1/models")
print("Stop the cluster with: make cluster-down")
PY
