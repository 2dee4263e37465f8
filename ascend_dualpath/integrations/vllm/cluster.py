"""The cluster the proxy places requests on: its prefill (PE) and decode (DE) instances, their nodes and groups.

Two ways to describe it:

- repeated command-line flags, one instance each: ``--prefill URL[,node=NAME][,kv=tcp://H:P]`` and
  ``--decode URL[,node=NAME][,group=G][,kv=tcp://H:P]``;
- a JSON file (``--cluster FILE``)::

      {"prefill": [{"url": "http://127.0.0.1:8100", "node": "n0"},
                   {"url": "http://127.0.0.1:8101", "node": "n1", "kv": "tcp://127.0.0.1:8201"}],
       "decode":  [{"url": "http://127.0.0.1:8200", "node": "n0", "group": 0},
                   {"url": "http://127.0.0.1:8300", "node": "n1", "group": 1}]}

Defaults: ``kv`` (the side channel) is the URL's host with port + 100 (what ``serve`` binds); ``node`` is the
instance's own (``pe<i>`` / ``de<i>``: every instance on a node of its own); ``group`` (DEs only) is 0. A node
is a storage NIC: the read queues of the instances on one node add up to the node's read queue, which the
scheduler compares with alpha. Instance names (``prefill<i>``, ``decode<i>``, in the order given) label the
proxy's metrics and decisions.

Data parallelism (``dp=D``, with the instance's ``tp=T``, both default 1): a vLLM server started with
``--data-parallel-size D`` runs D engines behind one URL, each with its own KV cache and its own DualPath connector
(side channel at the base port + ``k * T``, :func:`~ascend_dualpath.dualpath.settings.rank_port`). The proxy places
on each engine as on an instance of its own (``decode<i>.dp<k>``, on the instance's node: the engines share its
storage NIC) and sends its requests with vLLM's ``X-data-parallel-rank: k`` header.
"""

from __future__ import annotations

import dataclasses
import json
from urllib.parse import urlsplit

from ascend_dualpath.dualpath.settings import rank_port
from ascend_dualpath.errors import ConfigError

ROLES = ("prefill", "decode")
SIDE_PORT_OFFSET = 100  # an instance's side channel = its HTTP port + 100 (what serve binds)
NODE_PREFIX = {"prefill": "pe", "decode": "de"}  # default node of instance i: its own, pe<i> / de<i>
_KEYS = {"prefill": {"url", "node", "kv", "dp", "tp"}, "decode": {"url", "node", "kv", "group", "dp", "tp"}}
DP_HEADER = "X-data-parallel-rank"  # vLLM's OpenAI server routes a request to that data-parallel engine


def default_side_channel(url: str) -> str:
    """``tcp://<url host>:<url port + 100>``: where ``serve`` binds an instance's side channel."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"instance URL {url!r} is not http(s)://host[:port]")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"tcp://{parts.hostname}:{port + SIDE_PORT_OFFSET}"


@dataclasses.dataclass(frozen=True)
class Instance:
    """One vLLM engine the proxy places on: ``role`` "prefill" or "decode", its server's HTTP ``url`` and its
    connector's side channel ``kv``, its storage ``node`` and (DEs) decode ``group``; ``name`` is unique in the
    cluster. ``dp_rank``: the engine's data-parallel rank behind ``url`` (None: the server has one engine);
    ``dp_size``, ``tp_size``: the server's sizes."""

    name: str
    role: str
    url: str
    kv: str
    node: str
    group: int = 0
    dp_rank: int | None = None
    dp_size: int = 1
    tp_size: int = 1

    @property
    def headers(self) -> dict[str, str]:
        """What every request to this engine carries: vLLM's data-parallel rank header, when it has one."""
        return {} if self.dp_rank is None else {DP_HEADER: str(self.dp_rank)}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """All instances, PEs and DEs in the order given (engine ids: PEs 0..N-1, then DEs N..N+M-1)."""

    prefill: tuple[Instance, ...]
    decode: tuple[Instance, ...]

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ConfigError(
                f"a cluster needs at least one prefill and one decode instance, got {len(self.prefill)} and "
                f"{len(self.decode)}"
            )
        urls = [(i.url, i.dp_rank) for i in self.instances]
        duplicated = sorted({u for u, k in urls if urls.count((u, k)) > 1})
        if duplicated:
            raise ConfigError(f"instance URL(s) {duplicated} appear more than once in the cluster")
        kvs = [i.kv for i in self.instances]
        shared = sorted({kv for kv in kvs if kvs.count(kv) > 1})
        if shared:
            raise ConfigError(f"side channel(s) {shared} are given to more than one engine")

    @property
    def instances(self) -> tuple[Instance, ...]:
        return self.prefill + self.decode

    @property
    def servers(self) -> tuple[Instance, ...]:
        """One engine per vLLM server (its data-parallel rank 0): what ``/health`` and ``/metrics`` ask."""
        return tuple(i for i in self.instances if not i.dp_rank)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node names in order of first appearance."""
        return tuple(dict.fromkeys(i.node for i in self.instances))

    @property
    def groups(self) -> tuple[int, ...]:
        """DE group ids, sorted."""
        return tuple(sorted({i.group for i in self.decode}))


def _check_count(role: str, url: str, key: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{role} instance {url}: {key}={value!r} must be an int >= {minimum}")
    return value


def make_instance(role: str, index: int, url: str, node: str = "", kv: str = "", group: int = 0) -> Instance:
    """One instance of one engine with the defaults filled in (see the module docstring); validates the URL and
    group."""
    return make_instances(role, index, url, node, kv, group)[0]


def make_instances(
    role: str, index: int, url: str, node: str = "", kv: str = "", group: int = 0, dp: int = 1, tp: int = 1
) -> tuple[Instance, ...]:
    """The engines of one vLLM server (one per data-parallel rank, see the module docstring), defaults filled in;
    validates the URL, group and sizes."""
    if role not in ROLES:
        raise ConfigError(f"instance role {role!r} is not one of {ROLES}")
    url = url.rstrip("/")
    group = _check_count(role, url, "group", group, 0)
    dp, tp = _check_count(role, url, "dp", dp, 1), _check_count(role, url, "tp", tp, 1)
    base = kv or default_side_channel(url)
    default_side_channel(url)  # validates the URL even when kv is given
    host, _, port = base.rpartition(":")
    if not base.startswith("tcp://") or not port.isdigit():
        raise ConfigError(f"{role} instance {url}: kv={base!r} is not tcp://host:port")
    node, name = str(node or f"{NODE_PREFIX[role]}{index}"), f"{role}{index}"
    group = group if role == "decode" else 0
    if dp == 1:
        return (Instance(name, role, url, base, node, group, tp_size=tp),)
    return tuple(
        Instance(f"{name}.dp{k}", role, url, f"{host}:{rank_port(int(port), k * tp)}", node, group, k, dp, tp)
        for k in range(dp)
    )


def parse_instance_flag(role: str, index: int, text: str) -> Instance:
    """``URL[,node=NAME][,group=G][,kv=tcp://H:P]`` (group: DEs only) as given to ``--prefill`` / ``--decode``."""
    url, *options = text.split(",")
    fields: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in _KEYS[role] - {"url"}:
            raise ConfigError(
                f"--{role} {text!r}: option {option!r} is not one of {sorted(_KEYS[role] - {'url'})} as key=value"
            )
        fields[key] = value
    counts = {}
    for key, least in (("group", 0), ("dp", 1), ("tp", 1)):
        value = fields.pop(key, str(least))
        if not value.isdigit() or int(value) < least:
            raise ConfigError(f"--{role} {text!r}: {key}={value!r} must be an int >= {least}")
        counts[key] = int(value)
    return make_instances(role, index, url, **fields, **counts)


def cluster_from_flags(prefill: list[str], decode: list[str]) -> Cluster:
    """The cluster of repeated ``--prefill`` / ``--decode`` flags."""
    return Cluster(
        tuple(i for n, text in enumerate(prefill) for i in parse_instance_flag("prefill", n, text)),
        tuple(i for n, text in enumerate(decode) for i in parse_instance_flag("decode", n, text)),
    )


def cluster_from_dict(spec: dict, where: str = "cluster") -> Cluster:
    """The cluster of a parsed JSON description (the module docstring's format); ``where`` names it in errors."""
    if not isinstance(spec, dict) or set(spec) - set(ROLES):
        raise ConfigError(f"{where}: expected an object with keys {ROLES}, got {str(spec)[:200]}")
    parts = {}
    for role in ROLES:
        entries = spec.get(role) or []
        if not isinstance(entries, list):
            raise ConfigError(f"{where}: {role!r} must be a list of instances")
        instances = []
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict) or "url" not in entry or set(entry) - _KEYS[role]:
                raise ConfigError(
                    f"{where}: {role}[{index}] = {entry!r} must have 'url' and only keys {sorted(_KEYS[role])}"
                )
            instances.extend(make_instances(role, index, **entry))
        parts[role] = tuple(instances)
    return Cluster(parts["prefill"], parts["decode"])


def load_cluster(path: str) -> Cluster:
    """The cluster described in the JSON file ``path``."""
    try:
        with open(path) as f:
            spec = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--cluster {path!r}: cannot read a JSON cluster description: {exc}") from None
    return cluster_from_dict(spec, where=f"--cluster {path!r}")


def cluster_to_dict(cluster: Cluster) -> dict:
    """The JSON description of ``cluster`` (what ``serve`` writes for its proxy)."""
    out: dict[str, list[dict]] = {}
    for role, instances in (("prefill", cluster.prefill), ("decode", cluster.decode)):
        out[role] = []
        for i in instances:
            if i.dp_rank:  # a server's later engines follow from its first's entry
                continue
            entry = {"url": i.url, "kv": i.kv, "node": i.node}
            entry |= {"group": i.group} if role == "decode" else {}
            entry |= {"dp": i.dp_size, "tp": i.tp_size} if i.dp_size > 1 else {}
            out[role].append(entry)
    return out
