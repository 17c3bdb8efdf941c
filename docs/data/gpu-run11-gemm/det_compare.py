import json, sys
def load(p):
    return [json.loads(l) for l in open(p) if l.strip()]
def key(r):
    return (r.get("step"), r.get("loss"), r.get("grad_norm"), r.get("kept"))
a, b, what = load(sys.argv[1]), load(sys.argv[2]), sys.argv[3]
exact = sys.argv[4] == "exact"
if not a or len(a) != len(b):
    print(f"{what}: FAIL lengths {len(a)} vs {len(b)}"); sys.exit(1)
same = all(key(x) == key(y) for x, y in zip(a, b))
worst = max(abs(x["loss"] - y["loss"]) / max(1e-9, abs(y["loss"])) for x, y in zip(a, b))
gn = max(abs(x.get("grad_norm", 0) - y.get("grad_norm", 0)) / max(1e-9, abs(y.get("grad_norm", 1))) for x, y in zip(a, b))
ok = same if exact else worst < 2e-2
print(f"{what}: {'PASS' if ok else 'FAIL'} ({len(a)} steps, bit-identical loss+grad_norm: {same}, worst rel loss diff {worst:.2e}, grad_norm {gn:.2e}; losses {a[0]['loss']:.5f} -> {a[-1]['loss']:.5f})")
sys.exit(0 if ok else 1)
