"""The daemon's configuration: one dataclass, loaded from a TOML file, then `HYBRIDD_*`
environment variables, then command-line flags (each overriding the one before).

Each field is declared once, with its section, meaning, unit, allowed values and range
(`setting`): `hybridd start --help`, the example `systemd/hybridd.toml` and the README's
settings table are made from it (hybridd/settings_docs.py). Every field is validated here
with an error that names it, so a bad setting stops `hybridd start` before any worker is
spawned. The environment variables that are not settings are declared in
hybridd/environment.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridd import environment
from hybridd.kernels import gemm_fusions
from hybridd.protocol.supervisor import LOG_FORMATS, LOG_LEVELS
from hybridd.runtime.buckets import DEFAULT_DECODE_BUCKETS, DEFAULT_PREFILL_BUCKETS

# One day: longer deadlines are typos, and a drain deadline must fit in a timer.
MAX_TIMEOUT_S = 86400.0
MAX_BUSY_POLL_S = 10.0  # polling longer than this is a core spent for nothing
MAX_STEP_WAKE_POLL_S = 1.0  # a request is admitted in well under a millisecond
MAX_HEARTBEAT_INTERVAL_S = 60.0
MAX_KERNEL_COMPILE_WORKERS = 64  # each imports torch and Triton: a few hundred MB of memory

if TYPE_CHECKING:
    import torch

EMBEDDED_MODEL = Path(__file__).resolve().parent / "assets" / "tiny-shakespeare"
# Its draft for speculative decoding (`scripts/train_tiny.py --draft`).
EMBEDDED_DRAFT_MODEL = EMBEDDED_MODEL.parent / "tiny-shakespeare-draft"
# Its EAGLE-3 head (`scripts/train_tiny_eagle3.py`).
EMBEDDED_EAGLE3_HEAD = EMBEDDED_MODEL.parent / "tiny-shakespeare-eagle3"
ENV_PREFIX = "HYBRIDD_"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the field and source."""


def default_runtime_dir() -> str:
    # systemd's RuntimeDirectory= sets RUNTIME_DIRECTORY; a user's session has XDG_RUNTIME_DIR.
    if systemd_dirs := environment.get("RUNTIME_DIRECTORY"):
        return systemd_dirs.split(":")[0]
    if session_dir := environment.get("XDG_RUNTIME_DIR"):
        return str(Path(session_dir) / "hybridd")
    return f"/tmp/hybridd-{os.getuid()}"


@dataclass(frozen=True)
class Setting:
    """What a setting is, beside its name, type and default: the declaration that `--help`,
    the example `systemd/hybridd.toml` and the README's table are made from, and that
    `Config.validate` checks ranges and choices against."""

    section: str  # a key of SECTIONS
    meaning: str  # one paragraph, as a new user reads it
    unit: str = ""
    choices: tuple[str, ...] = ()  # the allowed values, when they are a list
    allowed: str = ""  # the allowed values in words, when they are not a list
    above: float | None = None  # exclusive lower bound
    at_least: float | None = None
    at_most: float | None = None
    default_text: str = ""  # for a default computed at start, or one that means "off"


_HOST_PORT = "HOST:PORT, [IPV6]:PORT or :PORT"
# Section key → (title, what the section's settings have in common).
SECTIONS: dict[str, tuple[str, str]] = {
    "model": ("Model", ""),
    "endpoints": ("Endpoints", "Where clients reach the daemon over ZeroMQ. TCP is served only with CURVE "
                  "(key pairs from `hybridd keygen`)."),
    "http": ("HTTP gateway and metrics", "The OpenAI-compatible gateway is a process of its own (restarted like "
             "the workers, shown by `hybridd status`), a client of the endpoint above. It binds only where told: "
             "keep it on loopback and put TLS in front with a reverse proxy (README, \"HTTP gateway\")."),
    "structured": ("Structured output and tools", "Outputs constrained to a JSON schema, a regex, a grammar or a "
                   "choice, and the chat's tool calls (README, \"Structured output and tools\")."),
    "batching": ("KV cache and batching", ""),
    "speculation": ("Speculative decoding", "Draft tokens verified in one step of the model: several tokens per "
                    "step where the drafts are right, the model's distribution either way."),
    "kernels": ("CUDA graphs and kernels", ""),
    "wakeups": ("Wake-ups and reply rings", ""),
    "lifecycle": ("Lifecycle", "Every deadline the supervisor applies (README, \"Troubleshooting\")."),
    "logging": ("Logging", ""),
}


def setting(default: Any = dataclasses.MISSING, *, section: str, meaning: str,
            factory: Callable[[], Any] | None = None, **declaration: Any) -> Any:
    """A Config field with its declaration (see `Setting`) as metadata."""
    metadata = {"setting": Setting(section, meaning, **declaration)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Config:
    # ---- model
    model: str = setting(str(EMBEDDED_MODEL), section="model", allowed="a directory or ORG/NAME",
                         default_text="the embedded tiny-shakespeare model",
                         meaning="The model: a local Hugging Face directory (config.json, safetensors weights, "
                                 "tokenizer), or a hub id (ORG/NAME) whose snapshot is in the local Hugging Face "
                                 "cache (`hf download ORG/NAME` puts it there; hybridd never downloads).")
    dtype: str = setting("auto", section="model", choices=("auto", "float32", "bfloat16", "float16"),
                         meaning="The dtype of the weights and the activations; auto is bfloat16 on CUDA and "
                                 "float32 on the CPU.")
    device: str = setting("auto", section="model", allowed="auto, cpu, cuda or cuda:N",
                          meaning="Where the model runs; auto is the first CUDA device when there is one, else "
                                  "the CPU.")
    quantization: str = setting("none", section="model", choices=("none", "fp8"),
                                meaning="fp8: the decoder's linear projections become FP8 E4M3 as the weights "
                                        "load, with one scale per output channel (half the bytes of bfloat16); "
                                        "embeddings, norms and the LM head stay in dtype. An FP8 checkpoint "
                                        "(compressed-tensors) is FP8 whatever this says.")
    # ---- endpoints
    runtime_dir: str = setting(section="endpoints", factory=default_runtime_dir, allowed="a directory",
                               default_text="$RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/hybridd, else "
                                            "/tmp/hybridd-UID",
                               meaning="The daemon's runtime directory (mode 0750): its pid file and sockets.")
    endpoint: str = setting("", section="endpoints", allowed="ipc://PATH",
                            default_text="ipc://RUNTIME_DIR/hybridd.sock",
                            meaning="The clients' endpoint, an ipc:// path.")
    tcp_endpoint: str = setting("", section="endpoints", allowed="tcp://HOST:PORT", default_text="off",
                                meaning="A TCP endpoint served beside the ipc:// one, e.g. tcp://0.0.0.0:7070. "
                                        "It needs curve_secret_key_file, and curve_client_keys_dir or "
                                        "curve_allow_any.")
    curve_secret_key_file: str = setting("", section="endpoints", allowed="a file", default_text="none",
                                         meaning="The daemon's CURVE secret key file (NAME.key_secret from "
                                                 "`hybridd keygen`); required by tcp_endpoint.")
    curve_client_keys_dir: str = setting("", section="endpoints", allowed="a directory", default_text="none",
                                         meaning="A directory of the public *.key files of the clients let in "
                                                 "over TCP.")
    curve_allow_any: bool = setting(False, section="endpoints",
                                    meaning="Let in any client that has a CURVE key pair, instead of the clients "
                                            "of curve_client_keys_dir.")
    # ---- HTTP
    http_endpoint: str = setting("", section="http", allowed=_HOST_PORT, default_text="off",
                                 meaning="HOST:PORT of the OpenAI-compatible HTTP gateway (/v1/completions, "
                                         "/v1/chat/completions, /v1/models, /health, /metrics), e.g. "
                                         "127.0.0.1:8000; :PORT alone is loopback.")
    http_api_key_file: str = setting("", section="http", allowed="a file", default_text="none (no key needed)",
                                     meaning="A file of API keys, one per line (# starts a comment); clients send "
                                             "Authorization: Bearer KEY. Needs http_endpoint.")
    http_cache_salt_by_api_key: bool = setting(False, section="http",
                                               meaning="Salt every request's prefix cache with (a digest of) its "
                                                       "API key, so that tenants never share KV blocks, nor the "
                                                       "timing that reveals them; a request's own cache_salt "
                                                       "then divides its tenant's share. Needs http_api_key_file.")
    served_model_name: list[str] = setting(section="http", factory=list, allowed="a comma list of names",
                                           default_text="the model directory's name (a hub id as given)",
                                           meaning="The names the gateway serves the model under: the first is "
                                                   "the one /v1/models lists and responses carry, each is accepted "
                                                   "as a request's model.")
    strict_openai: bool = setting(False, section="http",
                                  meaning="Refuse a request body's fields the gateway does not use (400 naming "
                                          "them) instead of ignoring them with a log line and the "
                                          "X-Hybridd-Ignored-Fields response header.")
    http_cors_origins: list[str] = setting(section="http", factory=list, allowed="a comma list of origins, or *",
                                           default_text="off (no CORS headers)",
                                           meaning="The browser origins allowed to call the gateway (CORS), e.g. "
                                                   "http://localhost:3000; * allows any.")
    metrics_endpoint: str = setting("", section="http", allowed=_HOST_PORT, default_text="off",
                                    meaning="HOST:PORT serving the Prometheus /metrics alone (the gateway serves "
                                            "it too), e.g. 127.0.0.1:9400; not the gateway's address.")
    tool_call_parser: str = setting("auto", section="structured",
                                    choices=("auto", "llama3_json", "hermes", "mistral"),
                                    meaning="How the gateway reads a chat's tool calls out of the model's text: "
                                            "llama3_json (Llama 3.1's {\"name\": ..., \"parameters\": ...}), "
                                            "hermes (Qwen2.5, Qwen3, Hermes: <tool_call>...</tool_call>), mistral "
                                            "([TOOL_CALLS] [...]); auto tells them from the model's chat template "
                                            "(llama3_json when it names none).")
    structured_compile_timeout_s: float = setting(10.0, section="structured", unit="s", above=0, at_most=600.0,
                                                  meaning="The longest a request's JSON schema, regex or grammar "
                                                          "may take to compile; a request whose constraint takes "
                                                          "longer is refused as invalid, naming it.")
    structured_cache_size: int = setting(256, section="structured", unit="grammars", above=0,
                                         meaning="Compiled constraints kept for reuse (by their text), least "
                                                 "recently used dropped first.")
    # ---- KV cache and batching
    block_size: int = setting(16, section="batching", unit="tokens", above=0,
                              meaning="Tokens per block of the paged KV cache.")
    num_kv_blocks: int = setting(0, section="batching", unit="blocks", at_least=0,
                                 meaning="Blocks in the KV cache; 0 sizes it from kv_cache_memory_fraction on "
                                         "CUDA, and on the CPU from the bytes of 512 blocks in the model's dtype "
                                         "(512 blocks, or more of an FP8 cache's).")
    kv_cache_memory_fraction: float = setting(0.5, section="batching", unit="fraction", allowed="0 < x < 1",
                                              meaning="With num_kv_blocks = 0 on CUDA, the share of the GPU's free "
                                                      "memory, after the weights, that the KV cache takes.")
    kv_cache_dtype: str = setting("auto", section="batching", choices=("auto", "fp8"),
                                  meaning="How the KV cache stores keys and values: auto in the model's dtype; fp8 "
                                          "as FP8 E4M3 with one float32 scale per token and KV head (the head "
                                          "vector's absmax / 448, no calibration), about half the bytes a block, "
                                          "so the same memory holds about twice the blocks. With fp8 the qkv "
                                          "projection's `rotary` fusion is not used (a separate kernel quantizes "
                                          "and writes the cache); a draft model's and an EAGLE-3 head's own KV "
                                          "caches stay in the model's dtype.")
    max_model_len: int = setting(0, section="batching", unit="tokens", at_least=0,
                                 meaning="The longest sequence, prompt and generated tokens together; 0 is the "
                                         "model's own limit, which a larger value is cut to.")
    max_batch: int = setting(32, section="batching", unit="sequences", above=0,
                             meaning="The most sequences decoded in one step: the largest decode bucket.")
    decode_buckets: list[int] = setting(section="batching", unit="sequences",
                                        factory=lambda: list(DEFAULT_DECODE_BUCKETS),
                                        meaning="Batch sizes captured as decode graphs before ready, largest "
                                                "first; a batch pads up to the next one. Sizes above max_batch "
                                                "are dropped and max_batch is added.")
    prefill_buckets: list[int] = setting(section="batching", unit="tokens",
                                         factory=lambda: list(DEFAULT_PREFILL_BUCKETS),
                                         meaning="Token counts captured as prefill graphs in the background after "
                                                 "ready, most demanded first; until one exists, its prefills run "
                                                 "eagerly. Sizes above max_prefill_tokens are dropped.")
    max_prefill_tokens: int = setting(2048, section="batching", unit="tokens", above=0,
                                      meaning="The token budget of a step in which no stream decodes: prompts "
                                              "are prefilled whole up to this many tokens in all, and a longer "
                                              "one in chunks of this size.")
    chunk_tokens: int = setting(256, section="batching", unit="tokens", above=0,
                                meaning="The token budget of a step in which streams decode: a decode row for "
                                        "every running stream, then prompt chunks up to this many tokens in all, "
                                        "so that no prompt stalls a stream. Such a step costs about max(weight "
                                        "bytes / memory bandwidth, 2 x parameters x tokens / matmul rate); the "
                                        "default keeps it within about 1.4x a decode step for 7B-8B models on an "
                                        "H100. More shortens prompts' time to first token beside running "
                                        "streams and lengthens those streams' inter-token latency. Above "
                                        "max_prefill_tokens, max_prefill_tokens is used.")
    max_prefill_seqs: int = setting(8, section="batching", unit="sequences", above=0,
                                    meaning="The most prompts prefilled in one step.")
    enable_prefix_caching: bool = setting(True, section="batching",
                                          meaning="Reuse the KV of full blocks that a request shares with an "
                                                  "earlier one (same tokens from the start, same cache_salt): "
                                                  "only the rest of its prompt is prefilled.")
    max_queued_requests: int = setting(256, section="batching", unit="requests", above=0,
                                       meaning="Requests in flight (running and waiting) beyond which a new one is "
                                               "refused as overloaded.")
    # ---- speculative decoding
    # Off by default until the GPU has measured it (the CPU showed no gain at one stream:
    # docs/lab/benchmarks.md), since a speculating step gives up the one-step-ahead pipeline
    # that the decode step's distance to its floor depends on.
    speculative_drafter: str = setting("none", section="speculation", choices=("none", "ngram", "draft_model",
                                                                                   "eagle3"),
                                       meaning="What proposes draft tokens for speculative decoding: ngram "
                                               "(prompt lookup: the tokens that followed the latest earlier "
                                               "occurrence of a sequence's last n tokens in its prompt and "
                                               "output; no model needed), draft_model (a small model with the "
                                               "model's tokenizer decodes them: speculative_draft_model), "
                                               "eagle3 (an EAGLE-3 head reads the model's own hidden states: "
                                               "speculative_eagle3_head) or none. Drafts are verified in one "
                                               "step of the model and keep its distribution exactly: greedy "
                                               "output is the one without speculation, and so is seeded "
                                               "sampling with ngram and eagle3; with draft_model sampled tokens "
                                               "are kept by rejection sampling (more are kept), and a seeded request "
                                               "gives the same output again when drafted the same "
                                               "(speculative_adaptive). Speculation is used per batch size where "
                                               "it has measured cheaper per token than plain decoding.")
    speculative_adaptive: bool = setting(True, section="speculation",
                                         meaning="Speculate only at the batch sizes where it has measured cheaper "
                                                 "per token than plain decoding (measured from the steps' times, "
                                                 "retried now and then); false speculates at every step. With "
                                                 "draft_model, a seeded sampled request's output depends on where "
                                                 "it was drafted: false makes that the same at every run of a "
                                                 "request alone.")
    num_speculative_tokens: int = setting(4, section="speculation", unit="tokens", at_least=1, at_most=16,
                                          meaning="The most draft tokens a sequence is verified with in one step; "
                                                  "each sequence drafts fewer while its drafts are rejected. A "
                                                  "verify step has a row per draft token beside the one per "
                                                  "sequence, within the largest decode bucket's rows.")
    speculative_ngram_min: int = setting(1, section="speculation", unit="tokens", at_least=1, at_most=16,
                                         meaning="The shortest suffix of a sequence that prompt lookup matches.")
    speculative_ngram_max: int = setting(4, section="speculation", unit="tokens", at_least=1, at_most=16,
                                         meaning="The longest suffix of a sequence that prompt lookup matches "
                                                 "(tried first); at least speculative_ngram_min.")
    speculative_draft_model: str = setting("", section="speculation", allowed="a directory",
                                           default_text="the embedded model's draft with the embedded model, "
                                                        "else none",
                                           meaning="The draft model of speculative_drafter draft_model: a local "
                                                   "Hugging Face directory of a small Llama-family model with the "
                                                   "model's tokenizer and vocabulary (refused at start otherwise). "
                                                   "It runs in the graph generator beside the model (its dtype "
                                                   "and device), with a KV cache of its own (a full batch of the "
                                                   "longest sequences, within 64K tokens) and CUDA graphs of its "
                                                   "own within a share of graph_memory_budget_mb.")
    speculative_eagle3_head: str = setting("", section="speculation", allowed="a directory",
                                           default_text="the embedded model's head with the embedded model, else none",
                                           meaning="The EAGLE-3 head of speculative_drafter eagle3: a local directory "
                                                   "in the published format (config.json of LlamaForCausalLMEagle3, "
                                                   "model.safetensors) trained for this model; a head whose sizes do "
                                                   "not fit the model is refused at start. It runs in the graph "
                                                   "generator beside the model, on its device and in its dtype (float32 "
                                                   "on the CPU), with a KV cache and CUDA graphs of its own, within "
                                                   "graph_memory_budget_mb.")
    # ---- CUDA graphs and kernels
    use_cuda_graphs: bool = setting(True, section="kernels",
                                    meaning="Replay the captured CUDA graphs; false runs every step eagerly.")
    graph_memory_budget_mb: int = setting(1024, section="kernels", unit="MiB", above=0,
                                          meaning="Memory the prefill graphs may hold together; beyond it the "
                                                  "least recently used one is evicted.")
    kernel_compile_workers: int = setting(8, section="kernels", unit="processes", at_least=0,
                                          at_most=MAX_KERNEL_COMPILE_WORKERS,
                                          meaning="Processes that compile the graphs' Triton kernels at start, all "
                                                  "at once, before the captures load them "
                                                  "(hybridd/runtime/kernel_precompile.py); at most the host's core "
                                                  "count are started. 0: each kernel compiles at its first launch, "
                                                  "one after another.")
    compile_sampler: bool = setting(True, section="kernels",
                                    meaning="On CUDA, sample with the fused Triton kernels (compiled at start) "
                                            "instead of eager torch.")
    cuda_mps: str = setting("auto", section="kernels", choices=("auto", "on", "off"),
                            meaning="Let the two workers share the CUDA device through a private MPS daemon, "
                                    "started and stopped by hybridd (hybridd/cuda_mps.py). auto: where "
                                    "nvidia-cuda-mps-control is installed and starts; on: required; off: never.")
    gemm_fusions: str = setting(gemm_fusions.DEFAULT, section="kernels",
                                allowed=f"a comma list of {', '.join(gemm_fusions.KNOWN)}; or none",
                                meaning="What the decode projections compute in their own kernel's epilogue "
                                        "(hybridd/kernels/gemm_fusions.py).")
    pdl: bool = setting(True, section="kernels",
                        meaning="Chain the fused Triton kernels by programmatic dependent launch on compute "
                                "capability 9 and newer (hybridd/kernels/pdl.py).")
    # ---- wake-ups and reply rings
    busy_poll_s: float = setting(0.0, section="wakeups", unit="s", at_least=0, at_most=MAX_BUSY_POLL_S,
                                 meaning="After its last piece of work each worker polls its sockets this long "
                                         "without sleeping, so that the next message is taken without a "
                                         "wake-up; each worker keeps a CPU core busy while it polls. 0: sleep "
                                         "at once.")
    step_wake_poll_s: float = setting(0.005, section="wakeups", unit="s", at_least=0, at_most=MAX_STEP_WAKE_POLL_S,
                                      meaning="When a request arrives while no step is in flight, the graph "
                                              "generator is told a step is coming and polls its socket until it "
                                              "comes, for at most this long, so that the step does not wait for "
                                              "its threads to wake. 0: it sleeps until the step wakes it.")
    max_reply_rings: int = setting(256, section="wakeups", unit="sessions", at_least=0,
                                   meaning="Client sessions that may have a shared-memory reply ring attached at "
                                           "once (each maps that client's memory; ipc/reply_ring.py); 0 refuses "
                                           "every ring.")
    # ---- lifecycle
    startup_timeout_s: float = setting(900.0, section="lifecycle", unit="s", above=0, at_most=MAX_TIMEOUT_S,
                                       meaning="Per worker, from its spawn to ready: loading, compiling, "
                                               "capturing. Keep it below TimeoutStartSec in hybridd.service.")
    heartbeat_interval_s: float = setting(0.25, section="lifecycle", unit="s", above=0,
                                          at_most=MAX_HEARTBEAT_INTERVAL_S,
                                          meaning="How often each serving loop reports that it is alive.")
    heartbeat_timeout_s: float = setting(10.0, section="lifecycle", unit="s", above=0, at_most=MAX_TIMEOUT_S,
                                         meaning="A serving loop silent this long is hung, and the worker pair "
                                                 "restarts; at least twice heartbeat_interval_s.")
    drain_timeout_s: float = setting(30.0, section="lifecycle", unit="s", above=0, at_most=MAX_TIMEOUT_S,
                                     meaning="On SIGTERM, how long running requests may finish before the rest "
                                             "are cancelled. Keep it below TimeoutStopSec in hybridd.service.")
    max_restarts: int = setting(5, section="lifecycle", unit="restarts", at_least=0,
                                meaning="Worker-pair restarts after failures before the supervisor gives up and "
                                        "exits 5.")
    restart_backoff_s: float = setting(1.0, section="lifecycle", unit="s", at_least=0, at_most=MAX_TIMEOUT_S,
                                       meaning="The wait before a restart; it doubles per consecutive failure, up "
                                               "to 60 s.")
    # ---- logging
    log_level: str = setting("info", section="logging", choices=LOG_LEVELS,
                             meaning="The lowest level of the log lines written to stderr.")
    log_format: str = setting("console", section="logging", choices=LOG_FORMATS,
                              meaning="console: one readable line per event; json: one JSON object per line.")

    @property
    def client_endpoint(self) -> str:
        return self.endpoint or f"ipc://{self.runtime_dir}/hybridd.sock"

    @property
    def supervisor_endpoint(self) -> str:
        return f"ipc://{self.runtime_dir}/supervisor.sock"

    def validate(self) -> Config:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value!r}")
        for f, declared in declarations():
            value = getattr(self, f.name)
            if declared.above is not None and value <= declared.above:
                bound = "positive" if declared.above == 0 else f"> {declared.above:g}"
                raise ConfigError(f"{f.name} must be {bound}, got {value!r}")
            if declared.at_least is not None and value < declared.at_least:
                raise ConfigError(f"{f.name} must be >= {declared.at_least:g}, got {value!r}")
        for f, declared in declarations():
            value = getattr(self, f.name)
            if declared.at_most is not None and value > declared.at_most:
                unit = " s" if declared.unit == "s" else ""
                raise ConfigError(f"{f.name} must be at most {declared.at_most:g}{unit}, got {value!r}")
        if self.speculative_drafter == "draft_model" and not draft_model_dir(self):
            raise ConfigError("speculative_drafter draft_model needs speculative_draft_model (a directory); only "
                              "the embedded model has a draft of its own")
        if self.speculative_drafter == "eagle3" and not eagle3_head_dir(self):
            raise ConfigError("speculative_drafter eagle3 needs speculative_eagle3_head (a directory); only the "
                              "embedded model has a head of its own")
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ConfigError(f"speculative_ngram_min ({self.speculative_ngram_min}) must be at most "
                              f"speculative_ngram_max ({self.speculative_ngram_max})")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ConfigError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must be at least twice "
                              f"heartbeat_interval_s ({self.heartbeat_interval_s:g})")
        self.log_level = self.log_level.lower()
        mps_modes = Config.__dataclass_fields__["cuda_mps"].metadata["setting"].choices
        if self.cuda_mps not in mps_modes:
            raise ConfigError(f"cuda_mps must be {', '.join(mps_modes[:-1])} or {mps_modes[-1]}, got {self.cuda_mps!r}")
        for f, declared in declarations():
            if declared.choices and getattr(self, f.name) not in declared.choices:
                raise ConfigError(f"{f.name} must be one of {', '.join(declared.choices)}, "
                                  f"got {getattr(self, f.name)!r}")
        if not 0 < self.kv_cache_memory_fraction < 1:
            raise ConfigError(f"kv_cache_memory_fraction must be in (0, 1), got {self.kv_cache_memory_fraction!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("decode_buckets", "prefill_buckets"):
            buckets = getattr(self, name)
            if not buckets or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in buckets):
                raise ConfigError(f"{name} must be a non-empty list of positive integers, got {buckets!r}")
        self.decode_buckets = sorted({b for b in self.decode_buckets if b <= self.max_batch} | {self.max_batch})
        self.prefill_buckets = sorted({b for b in self.prefill_buckets if b <= self.max_prefill_tokens})
        if not self.prefill_buckets:
            raise ConfigError(f"prefill_buckets: every bucket exceeds max_prefill_tokens {self.max_prefill_tokens}; "
                              f"give at least one of at most that many tokens")

        try:
            gemm_fusions.parse(self.gemm_fusions)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.cuda_mps == "on" and self.device == "cpu":
            raise ConfigError("cuda_mps = on needs a CUDA device, but device is cpu")
        if self.tcp_endpoint and not self.curve_secret_key_file:
            raise ConfigError("tcp_endpoint requires curve_secret_key_file (TCP is served only with CURVE)")
        if self.tcp_endpoint and not self.curve_client_keys_dir and not self.curve_allow_any:
            raise ConfigError("tcp_endpoint requires curve_client_keys_dir (the public keys of the clients allowed "
                              "in), or curve_allow_any = true to let in any client that has a CURVE key pair")
        if self.curve_allow_any and self.curve_client_keys_dir:
            raise ConfigError("curve_allow_any = true contradicts curve_client_keys_dir (an allow-list); set one")
        addresses = {}
        for name in ("http_endpoint", "metrics_endpoint"):
            if getattr(self, name):
                addresses[name] = parse_host_port(getattr(self, name), name)
        if len(addresses) == 2 and addresses["http_endpoint"] == addresses["metrics_endpoint"]:
            raise ConfigError("metrics_endpoint must differ from http_endpoint (the gateway serves /metrics too)")
        if self.http_api_key_file and not self.http_endpoint:
            raise ConfigError("http_api_key_file is set but http_endpoint is not")
        if self.http_cache_salt_by_api_key and not self.http_api_key_file:
            raise ConfigError("http_cache_salt_by_api_key is set but http_api_key_file is not: without keys "
                              "there is nothing to salt by")
        if self.endpoint and not self.endpoint.startswith("ipc://"):
            raise ConfigError(f"endpoint must be an ipc:// endpoint (use tcp_endpoint for TCP), got {self.endpoint!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def serves_http(self) -> bool:
        """Whether the gateway process runs (for the API, the metrics endpoint or both)."""
        return bool(self.http_endpoint or self.metrics_endpoint)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> Config:
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"{source}: unknown setting(s) {', '.join(unknown)}")
        config = cls()
        for name, value in values.items():
            setattr(config, name, _coerce(name, known[name], value, source))
        return config.validate()


def declarations() -> list[tuple[dataclasses.Field, Setting]]:
    """Every setting's field with its declaration, in the order of the sections."""
    return [(f, f.metadata["setting"]) for f in dataclasses.fields(Config)]


def default_of(f: dataclasses.Field) -> Any:
    """The field's default value (a fresh one for a factory's)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def kind_of(f: dataclasses.Field) -> str:
    """The value a setting takes, in words."""
    return {"bool": "true or false", "int": "integer", "float": "number", "str": "text",
            "list[int]": "comma list of integers", "list[str]": "comma list of names"}[_field_type(f)]


def describe_default(f: dataclasses.Field) -> str:
    """The default as `--help` and the README show it."""
    declared: Setting = f.metadata["setting"]
    if declared.default_text:
        return declared.default_text
    value = default_of(f)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def describe_allowed(f: dataclasses.Field) -> str:
    """The allowed values in words: the choices, the range, or the kind of value."""
    declared: Setting = f.metadata["setting"]
    if declared.choices:
        return ", ".join(declared.choices)
    if declared.allowed:
        return declared.allowed
    bounds = []
    if declared.above is not None:
        bounds.append(f"> {declared.above:g}")
    if declared.at_least is not None:
        bounds.append(f">= {declared.at_least:g}")
    if declared.at_most is not None:
        bounds.append(f"<= {declared.at_most:g}")
    if bounds:
        return f"{kind_of(f)} {', '.join(bounds)}"
    return kind_of(f)


def parse_host_port(value: str, name: str) -> tuple[str, int]:
    """`HOST:PORT`, `[IPV6]:PORT` or `:PORT` (loopback) → (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name} must be HOST:PORT with a port in 1..65535, got {value!r}")
    host = host.removeprefix("[").removesuffix("]") or "127.0.0.1"
    if any(c.isspace() or c in "/[]" for c in host):
        raise ConfigError(f"{name}: invalid host {host!r} in {value!r}")
    return host, int(port)


def _field_type(f: dataclasses.Field) -> str:
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def _coerce(name: str, f: dataclasses.Field, value: Any, source: str) -> Any:
    kind = _field_type(f)
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return value.lower() in ("1", "true", "yes", "on")
            raise ValueError(value)
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "list[int]":
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            return [int(v) for v in value]
        if kind == "list[str]":
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(value)
            return list(value)
        if kind == "str":
            if not isinstance(value, str):
                raise ValueError(value)
            return value
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: setting {name!r} expects {kind}, got {value!r}") from None
    return value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                environ: dict[str, str] | None = None) -> Config:
    """TOML file < HYBRIDD_* environment < explicit overrides (CLI flags)."""
    values: dict[str, Any] = {}
    environ = environment.snapshot() if environ is None else environ
    path = path or environ.get(ENV_PREFIX + "CONFIG")
    if path:
        path = Path(path)
        try:
            values.update(tomllib.loads(path.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        Config.from_dict(values, source=str(path))  # names the file in errors
    names = {f.name for f in dataclasses.fields(Config)}
    for key, value in environ.items():
        if not environment.is_setting_variable(key):
            continue
        if not value and key in environment.VARIABLES:  # logging's early read takes empty as unset too
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in names:
            raise ConfigError(f"environment: unknown setting {key}")
        values[name] = value
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return Config.from_dict(values, source="config")


def config_to_json(config: Config) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True)


# The device and dtype are resolved in the workers: torch is the daemon's dependency, and
# the client imports this module (for the default endpoint) without it.
def resolve_device(config: Config) -> torch.device:
    """The configured device, with an explicit index for CUDA (`set_device` needs one)."""
    import torch

    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


def resolve_dtype(config: Config, device: torch.device) -> torch.dtype:
    """The configured dtype; `auto` is bfloat16 on CUDA and float32 elsewhere."""
    import torch

    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.dtype)


def resolve_kv_cache_dtype(config: Config, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache stores keys and values in: the model's (`auto`), or FP8 E4M3."""
    import torch

    return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else model_dtype


def _with_embedded_default(config: Config, configured: str, embedded: Path) -> str:
    """`configured`, else `embedded` with the embedded model ("" with another model)."""
    if configured:
        return configured
    return str(embedded) if Path(config.model).resolve() == EMBEDDED_MODEL else ""


def eagle3_head_dir(config: Config) -> str:
    """The EAGLE-3 head's directory: speculative_eagle3_head, else the embedded model's
    head with the embedded model ("" with another model)."""
    return _with_embedded_default(config, config.speculative_eagle3_head, EMBEDDED_EAGLE3_HEAD)


def draft_model_dir(config: Config) -> str:
    """The draft model's directory: speculative_draft_model, else the embedded model's
    draft with the embedded model ("" with another model)."""
    return _with_embedded_default(config, config.speculative_draft_model, EMBEDDED_DRAFT_MODEL)
