"""The configured log level applies to loggers bound before it was set (module-level ones)."""

import ast
import subprocess
import sys


def test_level_set_after_binding_still_filters():
    code = (
        "from hybridd.log import get_logger, configure\n"
        "log = get_logger('early')\n"
        "configure('warning')\n"
        "log.info('quiet_info')\n"
        "log.warning('loud_warning')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PATH": ""})
    assert "loud_warning" in out.stderr and "quiet_info" not in out.stderr


def test_a_record_and_its_newline_go_out_in_one_write():
    """Processes sharing one unbuffered stderr (a redirected file) interleave whole writes:
    a record written apart from its newline could be split by another's record."""
    code = (
        "import sys\n"
        "class Writes:\n"
        "    def __init__(self): self.calls = []\n"
        "    def write(self, s): self.calls.append(s); return len(s)\n"
        "    def flush(self): pass\n"
        "from hybridd.log import get_logger, configure\n"
        "configure('info', json=True)\n"
        "capture = Writes(); real = sys.stderr; sys.stderr = capture\n"
        "get_logger('t').info('one record', n=1)\n"
        "sys.stderr = real\n"
        "print(repr(capture.calls))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    calls = ast.literal_eval(out.stdout)
    assert len(calls) == 1 and calls[0].endswith("\n") and '"one record"' in calls[0], calls


def test_an_exception_python_cannot_raise_is_logged_as_one_json_event():
    """An exception in a finalizer, a __del__ or an atexit callback (Python prints it as
    "Exception ignored in ...", not through the logger) is an event like any other, so
    that in JSON mode every line of a worker's output is JSON (once, a worker's exit
    printed such a line into the daemon's JSON log)."""
    import json

    code = (
        "import atexit\n"
        "from hybridd.log import configure\n"
        "configure('info', json=True)\n"
        "def fail(): raise RuntimeError('exit callback failed')\n"
        "atexit.register(fail)\n"
        "class Broken:\n"
        "    def __del__(self): raise ValueError('del failed')\n"
        "Broken()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stderr.splitlines()
    assert lines and all(line.startswith("{") for line in lines), out.stderr
    events = [json.loads(line) for line in lines]
    ignored = [e for e in events if e["event"] == "exception_ignored"]
    assert len(ignored) == 2, events
    assert any("del failed" in e["exception"] for e in ignored) and any("exit callback failed" in e["exception"]
                                                                      for e in ignored), ignored
