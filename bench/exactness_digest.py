"""sha1s of the detector suite's findings and state_dict (msgpack) on fixed inputs: run on two commits and diff the output
(an optimisation must leave every line the same). ``PYTHONPATH=$PWD python bench/exactness_digest.py [name filter...]``"""
import hashlib, math, random, sys, tempfile, pathlib, glob
import msgpack
sys.path.insert(0, "bench")
from _records import RecordFactory
from bench_postmortem import write_csv
from stability.detectors.engine import RunDiagnoser
from stability.records import StepRecord
from stability.postmortem import analyze, load_source

def h(obj):
    return hashlib.sha1(repr(obj).encode()).hexdigest()[:12]

def st(d):
    return hashlib.sha1(msgpack.packb(d.state_dict(), use_bin_type=True, default=repr)).hexdigest()[:12]

def run(records):
    d = RunDiagnoser()
    found = []
    for i, r in enumerate(records):
        found.extend(d.update(r))
        if i == len(records) // 2:
            mid = st(d)
    found.extend(d.finish())
    return h(found) + " " + mid + " " + st(d)

only = sys.argv[1:]
cases = {}
for seed in (0, 1, 2):
    for modules in (40, 3):
        steps = 1500 if modules == 40 else 4000
        for ranks in ((0,), (0, 1, 2)) if modules == 3 else ((0,),):
            facs = [RecordFactory(run_id="x", rank=k, modules=modules, seed=seed, total_steps=steps,
                                  stats_every=1 if seed != 2 else 10) for k in ranks]
            rng = random.Random(seed)
            recs = []
            for s in range(steps):
                for f in facs:
                    a = None
                    if s > 300 and rng.random() < 0.004:
                        a = rng.choice(["nan", "layer_grad", "spike"])
                    r = f.record(s, 1000.0 + s, anomaly=a)
                    if seed == 1:
                        sig = dict(r.signals)
                        sc = 2.0 ** (16 - (s // 700) + (1 if s % 97 == 0 else 0))
                        sig["loss_scale"] = sc
                        r = StepRecord(run_id=r.run_id, step=r.step, rank=r.rank, wall_time=r.wall_time,
                                       host=r.host, coords=r.coords, signals=sig)
                    recs.append(r)
            cases[f"bench s{seed} m{modules} r{len(ranks)}"] = recs
tmp = pathlib.Path(tempfile.mkdtemp())
write_csv(tmp / "pm.csv", 20000, 4)
write_csv(tmp / "pm100.csv", 3000, 100)
files = [str(tmp / "pm.csv"), str(tmp / "pm100.csv")] + sorted(glob.glob("/work/shared/data/real-runs/*.csv"))
for name, recs in cases.items():
    if only and not any(o in name for o in only): continue
    print(name, run(recs), flush=True)
for f in files:
    name = pathlib.Path(f).name
    if only and not any(o in name for o in only): continue
    log = load_source(f, loss_averaged=False)
    res = analyze(log.records, "b", segments=log.segments, events=log.events, progress=False)
    print(name, len(log.records), h((res.incidents, res.alerts, res.log_events)), run(sorted(log.records, key=lambda r: (r.step, r.rank))), flush=True)
