"""A real Slurm cluster on this machine, for ``make test-slurm`` (tests/slurm/).

Debian's ``slurm-wlm`` daemons, unmodified: one ``slurmctld`` on a head node and one
``slurmd -N <node>`` per compute node, each node in its own network and UTS
namespace with its own address and host name, as the simulated hosts of tests/hosts/
are for PRRTE (there only the UTS namespace and one shared network).  The wiring:

* a *head* namespace (network, UTS, mount), held by a ``sleep``: a bridge ``br0``
  with 10.78.0.254 (the controller's address, host name ``slurmhead``: the login node
  from which the tests call ``sbatch``/``salloc``/``scancel``), and ``/etc/hosts``
  bind-mounted over with the cluster's names -- the name service a cluster has.  The
  machine's own interfaces and ``/etc/hosts`` are never touched.
* a node namespace per node (network and UTS; the head's mount namespace), held by a
  ``sleep``: a veth pair whose outer end is on ``br0`` and whose inner end is ``eth0``
  with 10.78.0.<i>, host name ``node<i>``.  Processes, files and memory stay shared,
  so the scratch directory is the cluster's shared file system.
* ``munged`` (authentication) with a key, socket and state of its own in the scratch
  directory, run as the ``munge`` user; every Slurm daemon and client reaches it
  through ``AuthInfo=socket=...``.

Every process in a namespace of the cluster is found by its ``/proc/<pid>/ns/net``:
that is how a node is lost (its slurmd and everything on it SIGKILLed, its network
gone with its holder) and how :meth:`Cluster.stop` leaves nothing behind.

Run as a script: ``cluster.py start|stop DIR`` (the Makefile's trap stops a cluster a
killed pytest left), ``cluster.py shell DIR`` (a shell on the head node).
"""

import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

HEAD = "slurmhead"
HEAD_ADDR = "10.78.0.254"
SUBNET = "10.78.0"
#: Seconds after which slurmctld marks a node that stopped answering DOWN (default 300).
SLURMD_TIMEOUT = 10
#: Seconds between Slurm's SIGTERM and SIGKILL for a job it ends (scancel, time limit,
#: preemption); Slurm's default.
KILL_WAIT = 30

CONF = """\
ClusterName=ehvd
SlurmctldHost={head}({head_addr})
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={scratch}/state
SlurmdSpoolDir={scratch}/spool/%n
SlurmctldPidFile={scratch}/run/slurmctld.pid
SlurmdPidFile={scratch}/run/slurmd.%n.pid
SlurmctldLogFile={scratch}/log/slurmctld.log
SlurmdLogFile={scratch}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
SlurmdTimeout={slurmd_timeout}
KillWait={kill_wait}
MessageTimeout=5
InactiveLimit=0
MinJobAge=300
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def net_ns(pid):
    """The network namespace of ``pid`` (its inode's name), or None if it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


#: The cluster's own processes (not a job's) besides the namespace holders.
DAEMONS = {"slurmctld", "slurmscriptd", "slurmd", "munged", "sleep"}


def _comm(pid):
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def pids_in(ns):
    """Every live process whose network namespace is ``ns``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and net_ns(entry) == ns:
            found.append(int(entry))
    return found


class Cluster:
    """A Slurm cluster of ``nodes`` compute nodes (2 CPUs each) under ``scratch``."""

    def __init__(self, scratch, nodes=2):
        self.scratch = Path(scratch)
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.state_file = self.scratch / "cluster.json"
        self.holders = {}  # name ("head" or a node) -> pid of the sleep holding its namespaces
        self.ns = {}  # name -> its network namespace
        self.daemons = {}  # name -> pid (munged, slurmctld, slurmd per node)
        self.conf = self.scratch / "slurm.conf"
        self.munge_socket = self.scratch / "munge" / "munge.socket"

    # -- environment for clients and jobs -------------------------------------------
    def env(self, extra=None):
        env = dict(os.environ)
        for name in list(env):  # an outer allocation must not leak into the cluster's
            if name.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")):
                del env[name]
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def head_cmd(self, cmd):
        """``cmd`` as run on the head (login) node."""
        return ["nsenter", "-t", str(self.holders["head"]), "-n", "-u", "-m", *cmd]

    def node_cmd(self, node, cmd):
        """``cmd`` as run on ``node``: its network and UTS namespaces, the head's mounts."""
        return ["nsenter", "-t", str(self.holders[node]), "-n", "-u",
                f"--mount=/proc/{self.holders['head']}/ns/mnt", *cmd]

    def sh(self, script, timeout=60, env=None, check=True):
        """A shell command on the head node; its CompletedProcess (text)."""
        proc = subprocess.run(self.head_cmd(["sh", "-c", script]), capture_output=True,
                              text=True, timeout=timeout, env=self.env(env))
        if check and proc.returncode != 0:
            raise RuntimeError(f"{script!r} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc

    # -- start ---------------------------------------------------------------------------
    def start(self):
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.scratch.chmod(0o755)
        for sub in ("state", "spool", "run", "log", "jobs"):
            (self.scratch / sub).mkdir(exist_ok=True)
        (self.scratch / "jobs").chmod(0o1777)
        try:
            self._start_munge()
            self._start_namespaces()
            self._write_conf()
            self._save()
            self._start_slurm()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self):
        munge = self.scratch / "munge"
        munge.mkdir(exist_ok=True)
        munge.chmod(0o755)  # munged: the socket's directory must be searchable by all
        key = munge / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        user = pwd.getpwnam("munge")
        for path in (munge, key):
            os.chown(path, user.pw_uid, user.pw_gid)
        proc = subprocess.Popen(
            ["munged", "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
             f"--seed-file={munge}/munged.seed"],
            user=user.pw_uid, group=user.pw_gid, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=open(self.scratch / "log" / "munged.err", "w"),
            start_new_session=True)
        self.daemons["munged"] = proc.pid
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("munged did not start: "
                                   + (self.scratch / "log" / "munged.err").read_text())
            time.sleep(0.05)

    def _holder(self, cmd):
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                start_new_session=True)
        deadline = time.monotonic() + 10
        while net_ns(proc.pid) == net_ns("self") or net_ns(proc.pid) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{cmd} did not start")
            time.sleep(0.01)
        return proc.pid

    def _start_namespaces(self):
        hosts = self.scratch / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + f"{HEAD_ADDR} {HEAD}\n" + "".join(
            f"{SUBNET}.{i} {node}\n" for i, node in enumerate(self.nodes, 1)))
        # unshare --mount makes the head's mounts private: the bind never reaches the machine.
        head = self._holder(["unshare", "--net", "--uts", "--mount", "sh", "-c",
                             f"mount --bind {hosts} /etc/hosts && hostname {HEAD} && "
                             "exec sleep infinity"])
        self.holders["head"] = head
        time.sleep(0.1)  # the bind mount happens right after the unshare
        self.sh("ip link set lo up && ip link add br0 type bridge && "
                f"ip addr add {HEAD_ADDR}/24 dev br0 && ip link set br0 up")
        for node in self.nodes:
            self._make_node(node)
        self.ns = {name: net_ns(pid) for name, pid in self.holders.items()}

    def _make_node(self, node):
        """``node``'s namespaces (network, UTS) and its link to the head's bridge."""
        i = self.nodes.index(node) + 1
        pid = self._holder(["nsenter", "-t", str(self.holders["head"]), "-m", "unshare",
                            "--net", "--uts", "sh", "-c",
                            f"hostname {node} && exec sleep infinity"])
        self.holders[node] = pid
        self.sh(f"ip link add v{node} type veth peer name eth0 netns {pid} && "
                f"ip link set v{node} master br0 && ip link set v{node} up")
        run(["nsenter", "-t", str(pid), "-n", "sh", "-c",
             f"ip link set lo up && ip addr add {SUBNET}.{i}/24 dev eth0 && ip link set eth0 up"])
        self.ns[node] = net_ns(pid)

    def revive(self, node, timeout=60):
        """Bring a lost ``node`` back: new namespaces, its slurmd, and (once Slurm marked
        it DOWN) ``scontrol update state=resume``; returns when it is idle."""
        self._make_node(node)
        self._save()
        self.start_slurmd(node)
        deadline = time.monotonic() + timeout
        while node not in self.idle():
            state = self.sh(f"sinfo -h -n {node} -o %t", check=False).stdout.strip()
            if state.startswith("down") or state.startswith("drain"):
                self.sh(f"scontrol update nodename={node} state=resume", check=False)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{node} not idle after {timeout} s: {state}")
            time.sleep(0.5)

    def _write_conf(self):
        nodes = "\n".join(f"NodeName={node} NodeAddr={SUBNET}.{i} CPUs=2 State=UNKNOWN"
                          for i, node in enumerate(self.nodes, 1))
        self.conf.write_text(CONF.format(
            head=HEAD, head_addr=HEAD_ADDR, munge_socket=self.munge_socket,
            scratch=self.scratch, slurmd_timeout=SLURMD_TIMEOUT, kill_wait=KILL_WAIT,
            nodes=nodes))

    def _daemon(self, name, ns_of, cmd):
        log = open(self.scratch / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(
            ["nsenter", "-t", str(self.holders[ns_of]), "-n", "-u", "-m", *cmd],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env(),
            start_new_session=True)
        self.daemons[name] = proc.pid
        self._save()
        return proc

    def _start_slurm(self):
        self._daemon("slurmctld", "head", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self.wait_for(lambda: self.sh("scontrol ping", check=False).returncode == 0, 30,
                      "slurmctld answers")
        for node in self.nodes:
            self.start_slurmd(node)
        self.wait_for(lambda: self.idle() == set(self.nodes), 60, "every node idle")

    def start_slurmd(self, node):
        # A node's holder: the head's mount namespace, the node's network and UTS.
        proc = subprocess.Popen(
            self.node_cmd(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)]),
            stdin=subprocess.DEVNULL, stdout=open(self.scratch / "log" / f"{node}.out", "ab"),
            stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)
        self.daemons[f"slurmd.{node}"] = proc.pid
        self._save()

    def idle(self):
        out = self.sh("sinfo -h -N -o '%N %t'", check=False).stdout.split()
        return {n for n, s in zip(out[::2], out[1::2]) if s == "idle"}

    @staticmethod
    def wait_for(cond, timeout, what, every=0.2):
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout} s for: {what}")
            time.sleep(every)

    # -- failures ------------------------------------------------------------------------
    def lose_node(self, node):
        """SIGKILL every process on ``node`` (its slurmd, slurmstepds, PRRTE daemon, ranks)
        and its namespace holder: the node and its network are gone at once."""
        victims = pids_in(self.ns[node])
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return victims

    def processes_on(self, node):
        """``[(pid, comm)]`` of the processes on ``node`` other than its holder."""
        found = []
        for pid in pids_in(self.ns[node]):
            if pid == self.holders.get(node):
                continue
            try:
                found.append((pid, Path(f"/proc/{pid}/comm").read_text().strip()))
            except OSError:
                pass
        return found

    # -- stop ------------------------------------------------------------------------------
    def _save(self):
        self.state_file.write_text(json.dumps(
            {"holders": self.holders, "ns": self.ns, "daemons": self.daemons}))

    @classmethod
    def load(cls, scratch):
        self = cls(scratch)
        state = json.loads(self.state_file.read_text())
        self.holders, self.ns, self.daemons = state["holders"], state["ns"], state["daemons"]
        return self

    def stop(self):
        """End every process of the cluster: each in one of its namespaces (daemons, job
        steps, PRRTE daemons, ranks, holders), then munged.  Returns what was left
        running besides the daemons and holders (stray processes of jobs)."""
        strays = []
        ours = set(self.ns.values()) - {None}
        infra = set(self.holders.values()) | {p for n, p in self.daemons.items() if n != "munged"}
        # slurmctld first, so it does not see the nodes go one after the other
        for pass_ in range(20):
            pids = [int(e) for e in os.listdir("/proc") if e.isdigit() and net_ns(e) in ours]
            pids = [p for p in pids if p != os.getpid()]
            if not pids:
                break
            for pid in pids:
                if pass_ == 0 and pid not in infra and _comm(pid) not in DAEMONS:
                    try:
                        strays.append((pid, Path(f"/proc/{pid}/comm").read_text().strip()))
                    except OSError:
                        pass
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        munged = self.daemons.get("munged")
        if munged:
            try:
                if Path(f"/proc/{munged}/comm").read_text().strip() == "munged":
                    os.kill(munged, signal.SIGTERM)
            except OSError:
                pass
        return strays


def main(argv):
    what, scratch = argv[1], argv[2]
    if what == "start":
        cluster = Cluster(scratch).start()
        print(f"cluster up: SLURM_CONF={cluster.conf}; head: {cluster.head_cmd(['sh'])}")
    elif what == "stop":
        if Path(scratch, "cluster.json").exists():
            strays = Cluster.load(scratch).stop()
            print(f"cluster stopped ({len(strays)} stray processes killed)")
    elif what == "shell":
        cluster = Cluster.load(scratch)
        os.execvpe("nsenter", cluster.head_cmd(["bash"]), cluster.env())
    else:
        sys.exit(f"usage: {argv[0]} start|stop|shell DIR")


if __name__ == "__main__":
    main(sys.argv)
