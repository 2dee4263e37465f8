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
"""

from __future__ import annotations

import dataclasses
import json
from urllib.parse import urlsplit

from ascend_dualpath.errors import ConfigError

ROLES = ("prefill", "decode")
SIDE_PORT_OFFSET = 100  # an instance's side channel = its HTTP port + 100 (what serve binds)
NODE_PREFIX = {"prefill": "pe", "decode": "de"}  # default node of instance i: its own, pe<i> / de<i>
_KEYS = {"prefill": {"url", "node", "kv"}, "decode": {"url", "node", "kv", "group"}}


def default_side_channel(url: str) -> str:
    """``tcp://<url host>:<url port + 100>``: where ``serve`` binds an instance's side channel."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"instance URL {url!r} is not http(s)://host[:port]")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"tcp://{parts.hostname}:{port + SIDE_PORT_OFFSET}"


@dataclasses.dataclass(frozen=True)
class Instance:
    """One vLLM instance: ``role`` "prefill" or "decode", its HTTP ``url`` and side channel ``kv``, its storage
    ``node`` and (DEs) decode ``group``; ``name`` is unique in the cluster."""

    name: str
    role: str
    url: str
    kv: str
    node: str
    group: int = 0


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
        urls = [i.url for i in self.instances]
        duplicated = sorted({u for u in urls if urls.count(u) > 1})
        if duplicated:
            raise ConfigError(f"instance URL(s) {duplicated} appear more than once in the cluster")

    @property
    def instances(self) -> tuple[Instance, ...]:
        return self.prefill + self.decode

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node names in order of first appearance."""
        return tuple(dict.fromkeys(i.node for i in self.instances))

    @property
    def groups(self) -> tuple[int, ...]:
        """DE group ids, sorted."""
        return tuple(sorted({i.group for i in self.decode}))


def make_instance(role: str, index: int, url: str, node: str = "", kv: str = "", group: int = 0) -> Instance:
    """One instance with the defaults filled in (see the module docstring); validates the URL and group."""
    if role not in ROLES:
        raise ConfigError(f"instance role {role!r} is not one of {ROLES}")
    url = url.rstrip("/")
    if not isinstance(group, int) or isinstance(group, bool) or group < 0:
        raise ConfigError(f"{role} instance {url}: group={group!r} must be an int >= 0")
    kv = kv or default_side_channel(url)
    default_side_channel(url)  # validates the URL even when kv is given
    node = node or f"{NODE_PREFIX[role]}{index}"
    return Instance(f"{role}{index}", role, url, kv, str(node), group if role == "decode" else 0)


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
    group = fields.pop("group", "0")
    if not group.isdigit():
        raise ConfigError(f"--{role} {text!r}: group={group!r} must be an int >= 0")
    return make_instance(role, index, url, group=int(group), **fields)


def cluster_from_flags(prefill: list[str], decode: list[str]) -> Cluster:
    """The cluster of repeated ``--prefill`` / ``--decode`` flags."""
    return Cluster(
        tuple(parse_instance_flag("prefill", i, text) for i, text in enumerate(prefill)),
        tuple(parse_instance_flag("decode", i, text) for i, text in enumerate(decode)),
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
            instances.append(make_instance(role, index, **entry))
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
        out[role] = [{"url": i.url, "kv": i.kv, "node": i.node} for i in instances]
        if role == "decode":
            for entry, instance in zip(out[role], instances, strict=True):
                entry["group"] = instance.group
    return out
