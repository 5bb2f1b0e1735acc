"""Configuration through the `hybridd` command: TOML < HYBRIDD_* environment < flags,
`--print-config`, and errors that name the setting and where it came from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hybridd.cli import main
from hybridd.kernels import gemm_fusions

HYBRIDD = str(Path(sys.executable).parent / "hybridd")


def _clean_env() -> dict[str, str | None]:
    # Unset every HYBRIDD_* variable of the test runner's own environment.
    return {key: None for key in os.environ if key.startswith("HYBRIDD_")}


def _print_config(args: list[str], env: dict[str, str] | None = None):
    result = CliRunner().invoke(main, ["start", "--print-config", *args], env=_clean_env() | (env or {}))
    return result


@pytest.fixture
def toml(tmp_path: Path) -> Path:
    path = tmp_path / "hybridd.toml"
    path.write_text('max_batch = 8\nblock_size = 32\ndrain_timeout_s = 12.5\nlog_level = "debug"\n')
    return path


def test_precedence_file_then_environment_then_flags(toml):
    result = _print_config(["--config", str(toml), "--max-batch", "16"],
                           env={"HYBRIDD_BLOCK_SIZE": "64", "HYBRIDD_MAX_BATCH": "4"})
    assert result.exit_code == 0, result.output
    config = json.loads(result.output)
    assert config["drain_timeout_s"] == 12.5  # file only
    assert config["block_size"] == 64  # environment over file
    assert config["max_batch"] == 16  # flag over environment over file
    assert config["decode_buckets"][-1] == 16
    assert config["log_level"] == "debug"


def test_config_file_from_environment_and_boolean_and_list_flags(toml):
    result = _print_config(["--no-use-cuda-graphs", "--prefill-buckets", "16,32"], env={"HYBRIDD_CONFIG": str(toml)})
    assert result.exit_code == 0, result.output
    config = json.loads(result.output)
    assert config["max_batch"] == 8
    assert config["use_cuda_graphs"] is False
    assert config["prefill_buckets"] == [16, 32]


@pytest.mark.parametrize(
    ("file_text", "env", "flags", "expected"),
    [
        ("block_size = 0\n", {}, [], "{file}: block_size must be positive"),
        ("bogus = 1\n", {}, [], "{file}: unknown setting(s) bogus"),
        ("max_batch = [\n", {}, [], "{file}: invalid TOML"),
        ("", {"HYBRIDD_BLOCK_SIZE": "0"}, [], "environment variable HYBRIDD_BLOCK_SIZE: block_size must be positive"),
        ("", {"HYBRIDD_MAX_BATCH": "many"}, [], "environment variable HYBRIDD_MAX_BATCH: setting 'max_batch' expects int"),
        ("", {"HYBRIDD_BOGUS": "1"}, [], "environment (HYBRIDD_*): unknown setting HYBRIDD_BOGUS"),
        ('gemm_fusions = "norm,gelu"\n', {}, [],
         f"{{file}}: gemm_fusions must be a comma list of {', '.join(gemm_fusions.KNOWN)} or 'none', got 'norm,gelu'"),
        ('kv_cache_dtype = "int8"\n', {}, [], "{file}: kv_cache_dtype must be one of auto, fp8, got 'int8'"),
        ("", {"HYBRIDD_GEMM_FUSIONS": ""}, [], "environment variable HYBRIDD_GEMM_FUSIONS: gemm_fusions must be"),
        ("", {"HYBRIDD_PDL": "maybe"}, [], "environment variable HYBRIDD_PDL: setting 'pdl' expects bool"),
        ("", {}, ["--max-batch", "x"], "command-line flag --max-batch: setting 'max_batch' expects int, got 'x'"),
        ("", {}, ["--dtype", "int4"], "command-line flag --dtype: dtype must be one of auto, float32, bfloat16, float16"),
        ("", {}, ["--drain-timeout-s", "0"], "command-line flag --drain-timeout-s: drain_timeout_s must be positive"),
        ("", {}, ["--tcp-endpoint", "tcp://0.0.0.0:7070"],
         "command-line flag --tcp-endpoint: tcp_endpoint requires curve_secret_key_file"),
        ("", {}, ["--tcp-endpoint", "tcp://0.0.0.0:7070", "--curve-secret-key-file", "/k/server.key_secret"],
         "tcp_endpoint requires curve_client_keys_dir (the public keys of the clients allowed in), "
         "or curve_allow_any = true"),
        ("", {}, ["--tcp-endpoint", "tcp://0.0.0.0:7070", "--curve-secret-key-file", "/k/server.key_secret",
                  "--curve-client-keys-dir", "/k/clients", "--curve-allow-any"],
         "curve_allow_any = true contradicts curve_client_keys_dir"),
    ],
)
def test_bad_setting_names_the_field_and_its_source(tmp_path, file_text, env, flags, expected):
    path = tmp_path / "bad.toml"
    path.write_text(file_text)
    result = _print_config(["--config", str(path), *flags], env=env)
    assert result.exit_code == 2
    assert result.output.startswith("hybridd: invalid configuration: ")
    assert expected.format(file=path) in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_kernel_settings_from_file_environment_and_flags(tmp_path):
    """The fused neighbours of the projections and PDL are daemon settings like the others;
    the graph generator applies them before it loads the model."""
    result = _print_config([])
    assert result.exit_code == 0, result.output
    defaults = json.loads(result.output)
    assert defaults["gemm_fusions"] == "norm,rotary" and defaults["pdl"] is True and defaults["cuda_mps"] == "auto"
    path = tmp_path / "k.toml"
    path.write_text('gemm_fusions = "rotary"\npdl = false\ncuda_mps = "off"\n')
    config = json.loads(_print_config(["--config", str(path)]).output)
    assert config["gemm_fusions"] == "rotary" and config["pdl"] is False and config["cuda_mps"] == "off"
    config = json.loads(_print_config([], env={"HYBRIDD_GEMM_FUSIONS": "none", "HYBRIDD_PDL": "0"}).output)
    assert config["gemm_fusions"] == "none" and config["pdl"] is False
    config = json.loads(_print_config(["--gemm-fusions", "norm"], env={"HYBRIDD_GEMM_FUSIONS": "none"}).output)
    assert config["gemm_fusions"] == "norm"


def test_the_step_tracers_variables_are_not_settings():
    """HYBRIDD_TRACE_* are read by the workers (hybridd/runtime/step_trace.py): `hybridd
    start` takes them as they are, and a misspelt setting is still refused."""
    result = _print_config([], env={"HYBRIDD_TRACE_DIR": "/tmp/trace", "HYBRIDD_TRACE_STEPS": "50"})
    assert result.exit_code == 0, result.output
    result = _print_config([], env={"HYBRIDD_TRACEDIR": "/tmp/trace"})
    assert result.exit_code == 2 and "unknown setting HYBRIDD_TRACEDIR" in result.output


def test_missing_config_file_is_named(tmp_path):
    result = _print_config(["--config", str(tmp_path / "nope.toml")])
    assert result.exit_code == 2
    assert f"{tmp_path / 'nope.toml'}: config file not found" in result.output


def test_print_config_from_the_installed_command(toml):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDD_")} | {"HYBRIDD_MAX_BATCH": "2"}
    done = subprocess.run([HYBRIDD, "start", "--config", str(toml), "--print-config"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["max_batch"] == 2
    assert done.stderr == ""  # stdout holds only the JSON; nothing was started
