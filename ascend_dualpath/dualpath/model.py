"""The DualPath bottleneck-free bandwidth model (paper §4.2).

Notation (the paper's): ``P`` and ``D`` are the numbers of prefill and decode *nodes*; each node has
``g`` accelerators, each paired with a compute NIC (CNIC) of bandwidth ``B``; one node's storage read
bandwidth is ``s * B``; ``M`` is one node's host-memory bandwidth (half duplex: reads and writes add).
With both read paths in use and load balanced, each PE-DE engine pair carries

* ``T_p = B s / (D g^2)`` of PE-read-path KV and ``T_c = B s / (P g^2)`` of DE-read-path KV,

and every per-NIC load below must stay within ``B`` (DRAM within ``M``). Solving for ``P/D`` gives
eq. 9: ``s/(g-s) <= P/D <= min((g-2s)/s, (g-s)/(2s), (M/(Bs)-3)/2)``.

All functions compute in exact :class:`fractions.Fraction` when their inputs are ints or Fractions,
and in float as soon as one input is a float.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from numbers import Rational, Real

from ascend_dualpath.errors import ConfigError

Number = Fraction | float


def _num(name: str, value: Real) -> Number:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ConfigError(f"{name} must be a real number, got {value!r}")
    return Fraction(value) if isinstance(value, Rational) else float(value)


def _check_topology(g: Real, s: Real) -> tuple[Number, Number]:
    g_, s_ = _num("g", g), _num("s", s)
    if g_ <= 0:
        raise ConfigError(f"g (accelerators per node) must be > 0, got {g}")
    if not 0 < s_ < g_:
        raise ConfigError(f"s (storage bandwidth per node in CNIC units) must satisfy 0 < s < g={g}, got {s}")
    return g_, s_


def pe_cnic_read_load(g: Real, s: Real) -> Number:
    """Load on one PE CNIC's read (egress-from-host) direction, in units of ``B``: ``2 s / g``.

    The PE-read-path KV crosses it twice (buffer -> HBM, then HBM -> DE buffer).
    """
    g_, s_ = _check_topology(g, s)
    return 2 * s_ / g_


def pe_cnic_write_load(g: Real, s: Real, p_over_d: Real) -> Number:
    """Load on one PE CNIC's write direction in units of ``B``: ``(s/g)(1 + D/P)``."""
    g_, s_ = _check_topology(g, s)
    ratio = _positive_ratio(p_over_d)
    return s_ / g_ * (1 + 1 / ratio)


def de_cnic_read_load(g: Real, s: Real, p_over_d: Real) -> Number:
    """Load on one DE CNIC's read direction in units of ``B``: ``(s/g)(P/D + 2)``."""
    g_, s_ = _check_topology(g, s)
    return s_ / g_ * (_positive_ratio(p_over_d) + 2)


def de_cnic_write_load(g: Real, s: Real, p_over_d: Real) -> Number:
    """Load on one DE CNIC's write direction in units of ``B``: ``(s/g)(2 P/D + 1)``."""
    g_, s_ = _check_topology(g, s)
    return s_ / g_ * (2 * _positive_ratio(p_over_d) + 1)


def de_dram_load(storage_bw: Real, p_over_d: Real) -> Number:
    """Host-memory traffic of one DE node, in the unit of ``storage_bw`` (= ``B s``): ``(3 + 2 P/D) B s``."""
    return (3 + 2 * _positive_ratio(p_over_d)) * _num("storage_bw", storage_bw)


def pe_dram_load(storage_bw: Real) -> Number:
    """Host-memory traffic of one PE node: ``2 B s`` (storage -> buffer, buffer -> HBM)."""
    return 2 * _num("storage_bw", storage_bw)


def _positive_ratio(p_over_d: Real) -> Number:
    ratio = _num("p_over_d", p_over_d)
    if ratio <= 0:
        raise ConfigError(f"P/D must be > 0, got {p_over_d}")
    return ratio


@dataclass(frozen=True)
class PdRatioBounds:
    """The feasible interval of ``P/D`` and which constraint sets each end.

    ``upper_terms`` maps each upper-bound constraint name to its value; ``binding`` names the smallest.
    ``feasible`` is False when the interval is empty (lower > upper).
    """

    lower: Number
    upper: Number
    upper_terms: dict[str, Number]
    binding: str

    @property
    def feasible(self) -> bool:
        return self.lower <= self.upper

    def contains(self, p_over_d: Real) -> bool:
        return self.lower <= _num("p_over_d", p_over_d) <= self.upper


def pd_ratio_bounds(g: Real, s: Real, M: Real, Bs: Real) -> PdRatioBounds:  # noqa: N803 (paper names)
    """Bottleneck-free interval of the prefill/decode node ratio (paper eq. 9).

    Parameters
    ----------
    g : int
        Accelerators (and CNICs) per node.
    s : int | Fraction | float
        Storage bandwidth per node in units of one CNIC's bandwidth ``B`` (``0 < s < g``).
    M : int | Fraction | float
        Host-memory bandwidth per node, in any unit.
    Bs : int | Fraction | float
        Storage bandwidth per node (``B * s``), in the same unit as ``M``.

    Returns
    -------
    PdRatioBounds
        ``lower = s/(g-s)``, ``upper = min((g-2s)/s, (g-s)/(2s), (M/Bs-3)/2)``; exact Fractions when
        every input is an int or Fraction. ``g=8, s=1, M=500, Bs=50`` gives ``[1/7, 7/2]``.
    """
    g_, s_ = _check_topology(g, s)
    m_, bs_ = _num("M", M), _num("Bs", Bs)
    if bs_ <= 0:
        raise ConfigError(f"Bs (storage bandwidth per node) must be > 0, got {Bs}")
    if m_ <= 0:
        raise ConfigError(f"M (host memory bandwidth per node) must be > 0, got {M}")
    upper_terms: dict[str, Number] = {
        "de_cnic_read": (g_ - 2 * s_) / s_,
        "de_cnic_write": (g_ - s_) / (2 * s_),
        "de_dram": (m_ / bs_ - 3) / 2,
    }
    binding = min(upper_terms, key=lambda name: upper_terms[name])
    return PdRatioBounds(lower=s_ / (g_ - s_), upper=upper_terms[binding], upper_terms=upper_terms, binding=binding)
