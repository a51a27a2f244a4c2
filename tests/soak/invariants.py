"""The soak's invariants, judged from what the job reported, by rules of their own.

Why separate rules: a check that reused the library's bookkeeping (the sampler's
queue, the session's commit list, the rescaler's factor) would agree with the
library's bugs.  So each rule here is stated from first principles:

* **Same weights:** every rank that reports a step number reports the same digest
  of all its weights (ranks compared step by step, once every rank had time to
  write: ``SETTLE_S``).
* **Exactly once:** the counter entries that moved in the steps of one epoch (see
  ``job.py``) name every sample id exactly once, and within a step every applied
  sample moved by the same amount (a sample applied twice in one step moves twice
  as far).
* **Learning rate:** after every committed step, and in the event log after every
  change, the rate is ``BASE_LR x size``: the script sets ``BASE_LR x initial size``
  and the linear policy multiplies by new/old size at each change, whose product
  telescopes to ``BASE_LR x current size``.
  Checked after the step, where the library applies changes (at step
  boundaries); a step that *began* with a size its rate was not yet scaled for (a
  loss noticed in the growth check before it) is counted, not judged.
* **Step bound:** no gap between two consecutive committed steps is longer than
  ``STEP_BOUND_S``.  Why 10 s: the slowest legitimate step waits for the eviction
  of a SIGSTOPped rank (heartbeat timeout 2 s; docs/multi-host.md measures ~2-3 s each, two
  stopped ranks one after the other ~6 s), plus a join it may adopt (~1.4 s);
  what is left is slack for 4 ranks and a starting TensorFlow on 2 cores.
* **Memory:** each rank's RSS, after ``RSS_WARMUP_S`` of its life, grows by less than
  ``RSS_GROWTH`` (judged once at least ``RSS_SPAN_S`` of samples follow the warm-up).
* **Faults end processes, and only faults do:** a signalled rank is gone within
  ``VICTIM_GONE_S`` (SIGSTOPped ones are fenced by a survivor); a member nobody
  signalled does not vanish before the deadline.
* **No anomaly:** no ``elastic_hvd: ANOMALY`` line, no anomaly in a rank's final report.
"""

import collections
import dataclasses
import statistics
import time

from chaos import running, start_of

SETTLE_S = 5.0
STEP_BOUND_S = 10.0
RSS_WARMUP_S, RSS_SPAN_S, RSS_GROWTH = 60.0, 60.0, 0.05
VICTIM_GONE_S = 60.0
LR_RTOL = 1e-5


@dataclasses.dataclass
class Violation:
    t: float
    invariant: str
    evidence: str


class Invariants:
    """Checks ``records`` (a :class:`records.JobRecords`) as they grow."""

    def __init__(self, records, samples, base_lr, log):
        self.records, self.samples, self.base_lr, self.log = records, samples, base_lr, log
        self.violations = []
        self.checks = collections.Counter()  # invariant -> how many times it was checked
        self.lr_stale_steps = 0  # steps that began with a rate not yet rescaled
        self._steps_done, self._epochs_done, self._events_done = set(), set(), 0
        self._rss = {}  # (pid, start) -> [(time, kB)]
        self._rss_judged = set()
        self._victims_judged, self._vanished = set(), set()

    def violate(self, invariant, evidence):
        self.violations.append(Violation(time.time(), invariant, evidence))
        self.log(f"VIOLATION {invariant}: {evidence}")

    def count(self):
        return len(self.violations)

    def on_steps(self, new):
        for r in new:
            self.checks["learning rate"] += 1
            want = self.base_lr * r["size"]
            if abs(r["lr"] - want) > LR_RTOL * want:
                self.violate("learning rate", f"step {r['step']} pid {r['pid']}: lr {r['lr']} "
                             f"on {r['size']} ranks after the step, want {want}")
            if abs(r["lr_begin"] - self.base_lr * r["size_begin"]) > LR_RTOL * want:
                self.lr_stale_steps += 1  # see the module doc: an observation, not a rule
            if r["odd"]:
                self.violate("exactly once", f"step {r['step']} pid {r['pid']}: samples moved "
                             f"by other multiples of the step's unit {r['unit']}: {r['odd']}")
        for event in self.records.events[self._events_done:]:
            self._events_done += 1
            # Not a membership change: a resume, or an anomaly (that one is a violation
            # already, from its ANOMALY line in job.log: see the driver).
            if event.get("during") == "resume" or "anomaly" in event:
                continue
            self.checks["learning rate"] += 1
            want = self.base_lr * event["new_size"]
            if abs(event["lr_after"] - want) > LR_RTOL * want:
                self.violate("learning rate", f"event log: {event}: lr_after, want {want}")

    def settle(self, now, final=False):
        """Judge the steps and epochs every rank had time to report."""
        steps = sorted(self.records.steps)
        for previous, step in zip(steps, steps[1:]):
            if step in self._steps_done or (not final and now - self.records.commit_time[step]
                                            < SETTLE_S):
                continue
            self._steps_done.add(step)
            self._same_weights(step)
            self.checks["step bound"] += 1
            gap = self.records.commit_time[step] - self.records.commit_time[previous]
            if gap > STEP_BOUND_S:
                self.violate("step bound", f"step {step} committed {gap:.1f} s after step "
                             f"{previous} (bound {STEP_BOUND_S} s)")
        for epoch, ended in sorted(self.records.epoch_ends.items()):
            if epoch not in self._epochs_done and (final or now - ended >= SETTLE_S):
                self._epochs_done.add(epoch)
                self._exactly_once(epoch)

    def _same_weights(self, step):
        records = self.records.steps[step]
        self.checks["same weights"] += 1
        digests = collections.defaultdict(list)
        for r in records:
            digests[r["digest"][:12]].append(f"pid {r['pid']} rank {r['rank']}")
        if len(digests) > 1:
            self.violate("same weights", f"step {step}: {dict(digests)}")
        epochs = {r["epoch"] for r in records}
        if len(epochs) > 1:
            self.violate("exactly once", f"step {step}: ranks put it in epochs {sorted(epochs)}")

    def _exactly_once(self, epoch):
        self.checks["exactly once"] += 1
        applied = collections.Counter()
        for records in self.records.steps.values():
            if records[0]["epoch"] == epoch:
                applied.update(records[0]["applied"])
        missing = sorted(set(range(self.samples)) - set(applied))
        twice = sorted(i for i, n in applied.items() if n > 1)
        if missing or twice:
            self.violate("exactly once", f"epoch {epoch}: {len(missing)} samples never applied "
                         f"{missing[:10]}, {len(twice)} applied more than once "
                         f"{[(i, applied[i]) for i in twice[:10]]}")

    def sample_rss(self, pids):
        now = time.time()
        for pid in pids:
            try:
                start = start_of(pid)
                with open(f"/proc/{pid}/status") as f:
                    kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            except (OSError, StopIteration):
                continue
            if start is None or start_of(pid) != start:
                continue  # it ended (and its pid was taken) while being read
            samples = self._rss.setdefault((pid, start), [])
            samples.append((now, kb))
            self._judge_rss((pid, start), samples)

    def _judge_rss(self, process, samples):
        born = samples[0][0]
        warm = [kb for t, kb in samples if t >= born + RSS_WARMUP_S]
        if process in self._rss_judged or samples[-1][0] < born + RSS_WARMUP_S + RSS_SPAN_S:
            return
        base, now = statistics.median(warm[:3]), statistics.median(warm[-3:])
        self.checks["rss flat"] += 1
        if now > base * (1 + RSS_GROWTH):
            self._rss_judged.add(process)
            self.violate("rss flat", f"pid {process[0]}: {base} kB after warm-up, {now} kB "
                         f"{samples[-1][0] - born:.0f} s after its first sample")

    def rss_summary(self):
        """(pid, start) -> (seconds sampled, kB after warm-up, kB last) for the ranks judged."""
        out = {}
        for process, samples in self._rss.items():
            warm = [kb for t, kb in samples if t >= samples[0][0] + RSS_WARMUP_S]
            if samples[-1][0] >= samples[0][0] + RSS_WARMUP_S + RSS_SPAN_S:
                out[process] = (samples[-1][0] - samples[0][0], warm[0], samples[-1][1])
        return out

    def victims(self, faults, now):
        for fault in faults:
            key = (fault.pid, fault.t)
            if key in self._victims_judged or now - fault.t < VICTIM_GONE_S:
                continue
            self._victims_judged.add(key)
            self.checks["victims gone"] += 1
            if running(fault.pid, fault.start):  # a joiner too: its merge came before
                self.violate("victims gone", f"pid {fault.pid} still runs {now - fault.t:.0f} s "
                             f"after {fault.kind} ({fault.moment})")

    def vanished(self, touched):
        """Members that stopped running though no fault touched them (call before the
        deadline only: then every rank ends)."""
        for pid, last in self.records.latest.items():
            process = (pid, last["start"])
            if process in touched or process in self._vanished or running(*process):
                continue
            self._vanished.add(process)
            self.checks["only faults end ranks"] += 1
            self.violate("only faults end ranks", f"pid {pid} (id {last['id']}) is gone, no fault "
                         f"was sent to it; its last step was {last['step']}")

    def anomaly(self, line):
        self.violate("no anomaly", line.strip()[:400])

    def final_reports(self):
        for (pid, _), info in self.records.procs.items():
            if "end" in info:
                self.checks["no anomaly"] += 1
                for anomaly in info["end"]["anomalies"]:
                    self.violate("no anomaly", f"pid {pid} reported at its end: {anomaly}")
