"""Device bisect probe: start the daemon of the tree in cwd, time TTFT, batch-1 ITL, 32 streams."""
import asyncio, json, os, random, statistics, subprocess, sys, tempfile, time
from pathlib import Path

model, out, label = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
extra = sys.argv[4:]
VOCAB = int(os.environ.get("VOCAB", "30000"))
import hybridd
from hybridd import Client

base = Path(tempfile.mkdtemp(prefix="bis-"))
rd = base / "run"
cmd = [sys.executable, "-c", "import sys; from hybridd.cli import main; sys.exit(main())", "start", "--model", model,
       "--runtime-dir", str(rd), "--log-format", "json", *extra]
log = open(base / "d.log", "wb")
t0 = time.time()
p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"})
ep = f"ipc://{rd}/hybridd.sock"
res = {"label": label, "extra": extra}
try:
    while True:
        if p.poll() is not None:
            raise SystemExit(f"daemon exited {p.returncode}: " + (base / "d.log").read_text()[-3000:])
        try:
            with Client(ep) as c:
                if c.health(timeout=2, connect_timeout=2).ok:
                    break
        except Exception:
            pass
        time.sleep(0.5)
    res["ready_s"] = time.time() - t0
    # wait for prefill captures to finish (status buckets)
    with Client(ep) as c:
        for _ in range(240):
            st = c.status(timeout=10)
            pre = [b for b in st.get("buckets", []) if b.get("kind") == "prefill"]
            if pre and all(b.get("captured") or b.get("disabled") for b in pre):
                break
            time.sleep(0.5)
        rng = random.Random(1)
        S = {"temperature": 0.0, "ignore_eos": True}
        def ttft(n):
            ids = [rng.randrange(100, VOCAB) for _ in range(n)]
            t = time.perf_counter()
            for ch in c.stream(ids, max_tokens=1, timeout=120, **S):
                return time.perf_counter() - t
        res["ttft_ms"] = {}
        for n in (10, 32, 128, 256, 500):
            for _ in range(3):
                ttft(n)
            xs = sorted(ttft(n) for _ in range(int(os.environ.get("REPS", "15"))))
            res["ttft_ms"][n] = round(statistics.median(xs) * 1e3, 3)
        gaps = []
        for _ in range(2):
            ts = []
            ids = [rng.randrange(100, VOCAB) for _ in range(128)]
            for ch in c.stream(ids, max_tokens=129, timeout=120, **S):
                ts.append(time.perf_counter())
            gaps += [b - a for a, b in zip(ts[1:], ts[2:])]
        res["itl_p50_ms"] = round(statistics.median(gaps) * 1e3, 4)
    from hybridd.client import AsyncClient
    async def many(n, toks):
        client = AsyncClient(ep)
        async def one(ids):
            ts = [time.perf_counter()]
            async for ch in client.stream(ids, max_tokens=toks, timeout=300, **S):
                ts.append(time.perf_counter())
            return ts
        try:
            return await asyncio.gather(*(one([rng.randrange(100, VOCAB) for _ in range(128)]) for _ in range(n)))
        finally:
            await client.close()
    asyncio.run(many(32, 8))
    tps = []
    for _ in range(3):
        recs = asyncio.run(many(32, 128))
        start = min(r[0] for r in recs); end = max(r[-1] for r in recs)
        tps.append(32 * 128 / (end - start))
    res["tok_s_32"] = [round(x, 1) for x in tps]
    res["tok_s_32_med"] = round(statistics.median(tps), 1)
    with Client(ep) as c:
        st = c.status(timeout=10)
        res["buckets"] = [(b.get("kind"), b.get("size"), b.get("captures"), b.get("replays"), b.get("eager_runs"), b.get("bytes")) for b in st.get("buckets", [])]
finally:
    p.terminate()
    try:
        p.wait(60)
    except Exception:
        p.kill()
print(json.dumps(res), flush=True)
with open(out, "a") as f:
    f.write(json.dumps(res) + "\n")
