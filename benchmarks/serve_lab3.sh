# Sourced by the serving benchmarks: the 3-host lab up (CPU quotas 1.0 / 0.5 / 0.25) and serve_targets.py's model
# written under $OUT. Needs PYTHON, R (the CLI) and OUT; sets LAB_INVENTORY (the lab's inventory) and MODEL.
LAB_INVENTORY=$($R lab up --hosts=3 --cpus=lab-h1=1.0 --cpus=lab-h2=0.5 --cpus=lab-h3=0.25 --json \
  | $PYTHON -c "import json, sys; print(json.load(sys.stdin)['inventory'])")
MODEL=$($PYTHON -c "
from pathlib import Path
from benchmarks.serve_targets import MODEL_SIZES
from tests.serve_checkpoint import write_chat_llama
print(write_chat_llama(Path('$OUT') / 'serve-llama', seed=1, **MODEL_SIZES))" 2>/dev/null | tail -1)
