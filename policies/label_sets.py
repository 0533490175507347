"""Selectors and address sets judged by what they match, not by how they are spelled. (Not named
`selectors.py`: the CLI runs the pack with `policies/` as the script directory, where that name
would shadow the standard library module grpc imports.)

- A namespace selector matches every namespace a user can create unless one of its requirements
  asks for something a namespace must be given: a `matchLabels` entry, an `In`, or an `Exists` on a
  label other than `kubernetes.io/metadata.name`. That label is on every namespace: the API server
  sets it to the namespace's name on create and update (KEP-2161 "APIServer defaulted labels for
  all Namespaces", kubernetes/enhancements keps/sig-api-machinery/2161-apiserver-default-labels,
  GA in 1.22; kubernetes.io/docs/reference/labels-annotations-taints, `kubernetes.io/metadata.name`).
  So `{}`, `Exists` on that label, or only `NotIn`/`DoesNotExist` requirements select every namespace
  but a few (metav1 LabelSelector semantics: requirements are ANDed, an empty selector matches
  everything; k8s.io/apimachinery pkg/apis/meta/v1 types.go `LabelSelector`).
- A set of CIDRs covers the internet when its union, less its `except` blocks, holds every globally
  routable address of a family: all of IPv4 outside IANA's special-purpose blocks, or all of IPv6's
  global unicast `2000::/3` outside its special-purpose blocks (IANA IPv4/IPv6 Special-Purpose
  Address Registries, RFC 6890). `0.0.0.0/1` + `128.0.0.0/1` covers it without a `/0`.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Iterable, Mapping, Optional

from policies.common import as_list, as_map

METADATA_NAME = "kubernetes.io/metadata.name"

IPV4_SPECIAL = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24",
    "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
))
"""Not globally routable (IANA IPv4 Special-Purpose Address Registry; 224.0.0.0/4 multicast, RFC 5771;
240.0.0.0/4 reserved, RFC 1112, including 255.255.255.255)."""
IPV6_GLOBAL = ipaddress.ip_network("2000::/3")
"""Global unicast (IANA IPv6 Address Space registry): everything else is unassigned or special."""
IPV6_SPECIAL = tuple(ipaddress.ip_network(n) for n in ("2001::/23", "2001:db8::/32"))
"""IETF protocol assignments and documentation inside 2000::/3 (IANA IPv6 Special-Purpose Address Registry)."""


def selects_every_namespace(selector: Any) -> bool:
    """Whether a namespace selector matches every namespace a user can create (see the module doc).
    A selector no namespace can match (`DoesNotExist` on the name label, `In` with no values) does not."""
    if not isinstance(selector, Mapping):
        return False
    sel = as_map(selector)
    if as_map(sel.get("matchLabels")):
        return False
    for e in as_list(sel.get("matchExpressions")):
        e = as_map(e)
        key, op, values = e.get("key"), e.get("operator"), as_list(e.get("values"))
        if op == "In" or (op == "Exists" and key != METADATA_NAME):
            return False  # namespaces must carry something (an empty `In` matches none)
        if op == "DoesNotExist" and key == METADATA_NAME:
            return False  # every namespace has it: matches none
        if op not in ("NotIn", "Exists", "DoesNotExist") or (op == "NotIn" and not values):
            return False  # an invalid requirement: the API server rejects the object
    return True


def _networks(cidrs: Iterable[Any]) -> list:
    out = []
    for c in cidrs:
        try:
            out.append(ipaddress.ip_network(str(c).strip(), strict=False))
        except ValueError:
            continue
    return out


def _minus(nets: list, holes: list) -> list:
    """`nets` with every address of `holes` removed (same family)."""
    out = list(nets)
    for h in holes:
        nxt = []
        for n in out:
            if n.version != h.version or not n.overlaps(h):
                nxt.append(n)
            elif h.supernet_of(n):
                continue
            else:
                nxt.extend(n.address_exclude(h))
        out = nxt
    return out


def _covers(nets: list, target, special: tuple) -> bool:
    """Every address of `target` outside `special` is in `nets`."""
    missing = _minus([target], [n for n in nets if n.version == target.version])
    return not _minus(missing, list(special))


def internet_family(blocks: Iterable[tuple[Any, Iterable[Any]]]) -> Optional[str]:
    """`0.0.0.0/0` or `::/0` when the union of (cidr, excepts) blocks holds every globally routable
    address of that family, else None."""
    nets = []
    for cidr, excepts in blocks:
        nets += _minus(_networks([cidr]), _networks(excepts))
    if _covers(nets, ipaddress.ip_network("0.0.0.0/0"), IPV4_SPECIAL):
        return "0.0.0.0/0"
    if _covers(nets, IPV6_GLOBAL, IPV6_SPECIAL):
        return "::/0"
    return None
