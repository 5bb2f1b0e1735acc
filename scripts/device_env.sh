# Source on the GPU machine: installs the carried wheels and puts the checkout on
# PYTHONPATH. Usage: source scripts/device_env.sh
# The machine has torch, transformers, triton, msgpack and numpy; `.whl/` must hold wheels
# (Python 3.12, manylinux x86_64) of the rest of the server's dependencies: pyzmq,
# structlog, msgspec, click, setproctitle, prometheus_client, starlette, anyio, sniffio,
# uvicorn, h11, httptools, uvloop and llguidance. A missing one is named here, before any test or
# benchmark imports the package.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
python3 - <<'PY' || echo "device_env: install the modules named above from .whl/" >&2
import importlib.util
missing = [m for m in ("zmq", "structlog", "msgspec", "click", "setproctitle", "prometheus_client", "starlette",
                       "anyio", "uvicorn", "httptools", "uvloop", "llguidance") if importlib.util.find_spec(m) is None]
if missing:
    raise SystemExit("device_env: missing modules: " + ", ".join(missing))
PY
