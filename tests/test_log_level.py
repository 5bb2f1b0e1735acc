"""The configured log level applies to loggers bound before it was set (module-level ones)."""

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
