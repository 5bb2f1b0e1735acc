"""`hybridd start` with what cannot work: a clear one-line error, a bounded time, the
documented exit code, and no restart loop.

Settings, model directories and key files are refused before anything is spawned
(exit 2, well under the bound below even on a busy host); a model that only a worker
can find broken (truncated weights) ends the supervisor with exit 4 after one try.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from hybridd import exit_codes
from hybridd.config import EMBEDDED_MODEL
from hybridd import Client
from tests.daemon import HYBRIDD, clean_env, run_daemon

# Exit 2 takes about half a second on an idle host; the bound leaves room for a busy one.
REFUSAL_BOUND_S = 10.0


def _start(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([HYBRIDD, "start", *args], capture_output=True, text=True, timeout=timeout,
                          env=clean_env() | (env or {}))
    return done, time.monotonic() - started


def refused_at_start(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """The one error line of a `hybridd start` with `args` (its runtime directory in
    `tmp_path`, the sampler not compiled) that ends with STARTUP_FAILED, its workers
    spawned once."""
    done, _ = _start("--runtime-dir", str(tmp_path / "run"), "--no-compile-sampler", *args, timeout=300, env=env)
    assert done.returncode == exit_codes.STARTUP_FAILED, done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if "[error" in line]
    assert len(errors) == 1, errors
    assert done.stderr.count("spawned workers") == 1
    return errors[0]


def _model_copy(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL, model)
    return model


def _no_config(model: Path) -> None:
    (model / "config.json").unlink()


def _broken_config(model: Path) -> None:
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')


def _unsupported_config(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))


def _gptq_config(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq",
                                                                                     "bits": 4}}))


def _no_weights(model: Path) -> None:
    (model / "model.safetensors").unlink()


def _no_tokenizer(model: Path) -> None:
    (model / "tokenizer.json").unlink()


@pytest.mark.parametrize(("flags", "message"), [
    (["--heartbeat-interval-s", "nan"], "heartbeat_interval_s must be a finite number, got nan"),
    (["--heartbeat-interval-s", "inf"], "heartbeat_interval_s must be a finite number, got inf"),
    (["--drain-timeout-s", "nan"], "drain_timeout_s must be a finite number, got nan"),
    (["--log-level", "verbose"], "log_level must be one of debug, info, warning, error, critical, got 'verbose'"),
    (["--log-format", "xml"], "log_format must be one of console, json, got 'xml'"),
    (["--restart-backoff-s", "-1"], "restart_backoff_s must be >= 0, got -1.0"),
    (["--busy-poll-s", "-0.5"], "busy_poll_s must be >= 0, got -0.5"),
    (["--busy-poll-s", "11"], "busy_poll_s must be at most 10 s, got 11.0"),
    (["--step-wake-poll-s", "-0.001"], "step_wake_poll_s must be >= 0, got -0.001"),
    (["--step-wake-poll-s", "2"], "step_wake_poll_s must be at most 1 s, got 2.0"),
    (["--kernel-compile-workers", "-1"], "kernel_compile_workers must be >= 0, got -1"),
    (["--kernel-compile-workers", "65"], "kernel_compile_workers must be at most 64, got 65"),
    (["--startup-timeout-s", "0"], "startup_timeout_s must be positive, got 0.0"),
    (["--heartbeat-timeout-s", "0.3"], "heartbeat_timeout_s (0.3) must be at least twice heartbeat_interval_s (0.25)"),
    (["--num-speculative-tokens", "0"], "num_speculative_tokens must be >= 1, got 0"),
    (["--num-speculative-tokens", "17"], "num_speculative_tokens must be at most 16, got 17"),
    (["--speculative-drafter", "eagle"], "speculative_drafter must be one of none, ngram, draft_model, eagle3, got 'eagle'"),
    (["--kv-cache-dtype", "int8"], "kv_cache_dtype must be one of auto, fp8, got 'int8'"),
    (["--speculative-ngram-min", "3", "--speculative-ngram-max", "2"],
     "speculative_ngram_min (3) must be at most speculative_ngram_max (2)"),
    (["--model", "/nonexistent"], "model /nonexistent: no such directory"),
    (["--runtime-dir", "/etc/hostname/run"], "runtime_dir /etc/hostname/run: /etc/hostname is not a directory"),
    (["--runtime-dir", "/tmp/" + "r" * 120], "bytes; Unix sockets allow at most 107: choose a shorter runtime_dir"),
    (["--model", "/etc/hostname"], "model /etc/hostname: not a directory"),
    (["--tcp-endpoint", "tcp://127.0.0.1:1", "--curve-allow-any", "--curve-secret-key-file", "/no/such.key_secret"],
     "curve_secret_key_file /no/such.key_secret: cannot read"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_settings_are_refused_before_anything_starts(tmp_path, flags, message):
    done, elapsed = _start("--runtime-dir", str(tmp_path / "run"), *flags)
    assert done.returncode == exit_codes.USAGE, done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert elapsed < REFUSAL_BOUND_S
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize(("breakage", "message"), [
    (_no_config, "config.json: missing"),
    (_broken_config, "config.json: not valid JSON"),
    (_unsupported_config, "config.json: unsupported architecture 'GPT2LMHeadModel'"),
    (_gptq_config, "config.json: field 'quantization_config': quant_method 'gptq' is not supported"),
    (_no_weights, "no weights (*.safetensors or model.safetensors.index.json)"),
    (_no_tokenizer, "no tokenizer (tokenizer.json, tokenizer.model, vocab.json)"),
], ids=lambda v: getattr(v, "__name__", None))
def test_bad_model_directories_are_refused_naming_the_path(tmp_path, breakage, message):
    model = _model_copy(tmp_path)
    breakage(model)
    done, elapsed = _start("--runtime-dir", str(tmp_path / "run"), "--model", str(model))
    assert done.returncode == exit_codes.USAGE, done.stderr
    assert done.stderr.startswith("hybridd: cannot start: ") and str(model) in done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert elapsed < REFUSAL_BOUND_S


def test_the_same_refusal_from_the_config_file_and_the_environment(tmp_path):
    config = tmp_path / "hybridd.toml"
    config.write_text('log_level = "verbose"\n')
    done, _ = _start("--config", str(config))
    assert done.returncode == exit_codes.USAGE
    assert done.stderr.strip() == (f"hybridd: invalid configuration: config file {config}: log_level must be one of debug, info, "
                                   "warning, error, critical, got 'verbose'")
    done, _ = _start("--runtime-dir", str(tmp_path / "run"), env={"HYBRIDD_DRAIN_TIMEOUT_S": "nan"})
    assert done.returncode == exit_codes.USAGE
    assert "environment variable HYBRIDD_DRAIN_TIMEOUT_S: drain_timeout_s must be a finite number" in done.stderr


def test_truncated_weights_end_the_daemon_once_with_one_line(tmp_path):
    """Only the graph generator can find this: it reports it, the supervisor exits 4, no restart."""
    model = _model_copy(tmp_path)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    done, elapsed = _start("--runtime-dir", str(tmp_path / "run"), "--model", str(model), "--no-compile-sampler",
                           "--log-format", "json", timeout=300)
    assert done.returncode == exit_codes.STARTUP_FAILED, done.stderr[-4000:]
    records = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    errors = [r for r in records if r["level"] in ("error", "critical")]
    assert len(errors) == 1, errors
    assert errors[0]["event"].startswith(f"cannot start: graph generator: {weights}: ")
    assert "Traceback" not in done.stderr
    assert sum(r["event"] == "spawned workers" for r in records) == 1, "no restart"
    assert not (tmp_path / "run" / "hybridd.pid").exists()


def test_a_kv_cache_larger_than_memory_ends_the_daemon_once_with_one_line(tmp_path):
    """/dev/shm cannot hold it (on a GPU the same path is torch.OutOfMemoryError): exit 4, no restart."""
    shm = os.statvfs("/dev/shm")
    block_bytes = 2 * 4 * 16 * 4 * 64 * 4  # K and V, layers, block_size, heads, head_dim, float32: an underestimate
    # Beyond the whole of /dev/shm, not only its free part: tmpfs refuses that at once,
    # without filling the shared memory that other processes on the host use.
    blocks = 4 * shm.f_blocks * shm.f_frsize // block_bytes
    done, _ = _start("--runtime-dir", str(tmp_path / "run"), "--no-compile-sampler", "--num-kv-blocks", str(blocks),
                     timeout=300)
    assert done.returncode == exit_codes.STARTUP_FAILED, done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if "[error" in line]
    assert len(errors) == 1 and "cannot start: graph generator ran out of memory while starting" in errors[0], errors
    assert "Traceback" not in done.stderr
    assert done.stderr.count("spawned workers") == 1


def test_a_max_batch_that_cannot_fit_is_lowered_with_a_warning(tmp_path):
    """--max-batch 100000 beside a device memory the test sets (a figure the graph generator
    takes for the free memory): the daemon serves the largest decode bucket that fits and
    says so in one warning; it never reaches ready with a batch its memory cannot run."""
    with run_daemon("--max-batch", "100000", "--log-format", "json",
                    env={"HYBRIDD_TEST_FREE_MEMORY_BYTES": str(256 << 20)}) as daemon:
        with Client(daemon.endpoint) as client:
            decode = [b["size"] for b in client.status()["buckets"] if b["kind"] == "decode"]
            assert client.generate("ROMEO:", max_tokens=2).finish_reason == "length"
        log = daemon.log_path.read_text()
    assert 1 <= max(decode) < 100_000, decode
    warnings = [json.loads(line) for line in log.splitlines() if "cannot fit" in line]
    assert len(warnings) == 1 and warnings[0]["event"].startswith("max_batch 100000 cannot fit")
    assert f"serving max_batch {max(decode)} instead" in warnings[0]["event"]


def test_no_memory_for_a_batch_of_one_ends_the_daemon_once_with_one_line(tmp_path):
    # Room for the KV cache (64 blocks of the embedded model, 128 KiB each in float32) and a few bytes more.
    error = refused_at_start(tmp_path, "--num-kv-blocks", "64",
                             env={"HYBRIDD_TEST_FREE_MEMORY_BYTES": str(64 * 131072 + 1024)})
    assert "max_batch: not even a batch of 1 fits" in error, error
