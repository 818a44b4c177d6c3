#!/usr/bin/env python3
"""llama.cpp's own spread on a reference file: its top-5 at every greedy step, teacher-forced (the
prompt and the path so far sent as one batch, as real_families.rs does for strata), against the
file's step-by-step values, with the same measure (each log-probability minus the best one's).

    bench/llamacpp-spread.py LLAMA_BIN_DIR MODEL.gguf reference/FILE.json PORT [llama-server flags, e.g. -fa off]
"""
import http.client, json, subprocess, sys, time, os
bindir, model, ref, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]); extra = sys.argv[5:]
def call(path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600); c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse(); return json.loads(r.read())
srv = subprocess.Popen([os.path.join(bindir, "llama-server"), "-m", model, "-t", "2", "-np", "1", "-c", "4096", "--host", "127.0.0.1", "--port", str(port)] + extra, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(240):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2); c.request("GET", "/health")
            if c.getresponse().status == 200: break
        except OSError: pass
        time.sleep(0.5)
    r = json.load(open(ref)); diffs = []
    for g in r["greedy"]:
        for k, top in enumerate(g["top5_logprobs_per_step"]):
            ids = g["prompt_ids"] + g["generated_ids"][:k]
            o = call("/completion", {"prompt": ids, "n_predict": 1, "n_probs": 20, "samplers": ["top_k"], "top_k": 1, "post_sampling_probs": False, "cache_prompt": False, "temperature": 0})
            mine = {t["id"]: t["logprob"] for t in o["completion_probabilities"][0]["top_logprobs"]}
            best = top[0]["id"]; 
            if best not in mine: diffs.append(9.9); continue
            d = max(abs((mine.get(t["id"], -99) - mine[best]) - (t["logprob"] - top[0]["logprob"])) for t in top)
            diffs.append(d)
    n = len(diffs); w = sum(d <= 0.35 for d in diffs)
    print(f"{extra}: within 0.35 at {w}/{n} ({100*w/n:.1f}%), mean {sum(diffs)/n:.4f}, largest {max(diffs):.4f}")
finally:
    srv.terminate(); srv.wait()
