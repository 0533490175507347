"""The secrets scanner: credentials written in clear anywhere in a value tree.

A value is a credential by its shape (a known token format, whatever its name) or by its name (a key
or env var named like one, with a value that is not a flag, a path or a reference). References are
allowed explicitly: `valueFrom`/`secretKeyRef`/`secretRef`/`envFrom` subtrees, `existingSecret*`
keys, a `*Key` that names a key of a Secret (the charts' `existingSecret` + `passwordKey` pattern),
`*_file` paths, values the engine does not know yet (computed during preview) and, in Helm values,
Pulumi secrets (`policies/secret_values.py`). A finding never repeats the value.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from typing import Any, Iterator, Optional
from urllib.parse import parse_qsl, urlsplit

import yaml
from pulumi_policy.proxy import UnknownValueError

from policies.common import is_seq, is_unknown
from policies.secret_values import is_secret

SHAPES: tuple[tuple[str, re.Pattern], ...] = tuple((label, re.compile(rx)) for label, rx in (
    ("an AWS access key id", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    ("a GitHub token", r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,})"),
    ("a Slack token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
    ("a Slack webhook URL", r"https://hooks\.slack\.com/services/[A-Za-z0-9_/-]{10,}"),
    ("a Discord webhook URL", r"https://(?:discord|discordapp)\.com/api/webhooks/[0-9]+/[A-Za-z0-9_-]{10,}"),
    ("a Hugging Face token", r"\bhf_[A-Za-z0-9]{30,}"),
    ("an OpenAI-style API key", r"\bsk-(?:proj-)?[A-Za-z0-9_-]{32,}"),
    ("a Google API key", r"\bAIza[0-9A-Za-z_-]{35}"),
    ("a private key", r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"),
    ("a JSON Web Token", r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    ("a Bearer token", r"\bBearer\s+(?![$<{])[A-Za-z0-9._~+/-]{8,}=*"),
    ("a URL with credentials", r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@'\"]+:(?![$<{])[^/\s@'\"]+@"),
))
"""Token formats that are credentials under any name."""
SECRET_VALUE = re.compile("|".join(f"(?:{rx.pattern})" for _, rx in SHAPES))

_SECRET_NAME = re.compile(
    r"((^|_)(API_?KEY|ACCESS_KEY|SECRET_KEY|PRIVATE_KEY|ROUTING_KEY|SERVICE_KEY|WEBHOOK_URL)"
    r"|(TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|APIKEY|CREDENTIALS?))($|_)",
    re.IGNORECASE,
)
"""A credential word ending the name or a `_` part of it. The unambiguous words may follow a prefix
with no separator (`DBPASSWORD`, `IDENTITYTOKEN`, `REGISTRYTOKEN` in a registry credential file);
`TOKENS`, `TOKENIZER` or `PASSWORDLESS` are other words."""
_TOKEN_ONLY = re.compile(r"TOKEN($|_)", re.IGNORECASE)
_NUMBER = re.compile(r"^[+-]?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?$")
"""A number: under a name whose only credential word is TOKEN (`RATE_LIMIT_TOKEN=100`,
`TOKEN_BUDGET=4096`) it counts tokens of text, not an auth token."""
_NOT_A_SECRET_NAME = re.compile(
    r"(_(FILE|PATH|DIR|NAME|KEY_ID|REF|ENABLED|DISABLED|TTL|TIMEOUT|EXPIRY|LIFETIME|LENGTH|SIZE|COUNT|LIMIT|TYPE)$)"
    r"|((?<!WEBHOOK)_(URL|ENDPOINT)$)|(^|_)(DISABLE|ENABLE|USE|NO)_|(^|_)MAX_|(^|_)NUM_|(^|_)EXISTING_",
    re.IGNORECASE,
)
_BENIGN_VALUE = re.compile(
    r"^(0|1|true|false|yes|no|on|off|none|auto)$|^/|^\$\(|^\$\{|^\{\{|^\$__(file|env|vault)\{[^}]*\}$", re.IGNORECASE)
"""A flag, a file path (GOOGLE_APPLICATION_CREDENTIALS=/var/run/...), or a reference: to another
variable, a template, or Grafana's `$__file{<path>}`, `$__env{<VAR>}` and `$__vault{<ref>}`, which
Grafana expands when it reads its configuration, the documented way to keep a secret out of it
(grafana.com/docs/grafana/latest/setup-grafana/configure-grafana, "Variable expansion")."""
REFERENCE_KEYS = frozenset({"valueFrom", "secretKeyRef", "secretRef", "envFrom", "configMapKeyRef", "secretKeySelector"})
_KEY_NAME = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")
"""A Secret's data key (validation of Secret keys: `[-._a-zA-Z0-9]+`)."""
_KEY_WORDS = {"PASSWORD", "PASSWD", "TOKEN", "CREDENTIAL", "CREDENTIALS", "USER", "USERNAME", "SECRET"}
_SECRET_REF_SIBLINGS = re.compile(r"^(existingSecret|secretName|existing_secret|secret_name)", re.IGNORECASE)


def camel_to_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).replace("-", "_").replace(".", "_").upper()


def secret_name(name: str) -> bool:
    """A variable/key name that holds a credential (not a flag about one, a path to one or its name)."""
    n = camel_to_snake(name)
    return bool(_SECRET_NAME.search(n)) and not _NOT_A_SECRET_NAME.search(n)


def key_reference(name: str, value: Any, siblings: Mapping[str, Any] | None = None) -> bool:
    """`passwordKey: admin-password` names a key of a Secret (next to `existingSecret`), not a password:
    a camelCase `<word>Key` with a value shaped like a Secret key, where the word is a credential word
    or a sibling names the Secret."""
    if not isinstance(value, str) or not name.endswith("Key") or not _KEY_NAME.match(value) or SECRET_VALUE.search(value):
        return False
    word = camel_to_snake(name[:-3]).rsplit("_", 1)[-1]
    return word in _KEY_WORDS or any(_SECRET_REF_SIBLINGS.match(str(k)) for k in (siblings or {}))


def shape_of(value: str) -> Optional[str]:
    for label, rx in SHAPES:
        if rx.search(value):
            return label
    return None


_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
QUERY_CREDENTIALS = frozenset({"key", "sig", "signature", "auth", "x-amz-signature", "x-goog-signature"})
"""Query parameters that carry a credential under names the name rule does not know: API keys
(`?key=`), shared-access and presigned-URL signatures (Azure SAS `sig`, AWS SigV4 `X-Amz-Signature`,
GCS V4 `X-Goog-Signature`)."""
_REFERENCE = re.compile(r"^(\$\(|\$\{|\{\{|<|%\(|\$__)")


def query_credential(value: str) -> Optional[str]:
    """The name of a query parameter of a URL in `value` that carries a literal credential
    (`?api_key=...`, `&access_token=...`), or None."""
    for url in _URL.findall(value):
        try:
            params = parse_qsl(urlsplit(url).query, keep_blank_values=False)
        except ValueError:
            continue
        for k, v in params:
            if (secret_name(k.replace("-", "_")) or k.lower() in QUERY_CREDENTIALS) and not _REFERENCE.match(v) \
                    and not _BENIGN_VALUE.match(v) and not (_NUMBER.match(v) and _token_only(k)):
                return k
    return None


def registry_auth(name: str, value: str) -> bool:
    """A registry credential file's `auth`: base64 of `user:password` (the docker config.json
    `auths.<registry>.auth` that kubernetes.io/dockerconfigjson Secrets and registry clients read)."""
    if name.lower() != "auth" or len(value) < 8:
        return False
    try:
        text = base64.b64decode(value, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return False
    user, sep, password = text.partition(":")
    return bool(sep and user and password and text.isprintable())


def netrc_password(text: str) -> Optional[str]:
    """The machine of a `.netrc` entry with a literal `password` (ftp(1)/curl's netrc format:
    whitespace-separated `machine <host> login <user> password <password>`), or None."""
    words = text.split()
    if not any(w in ("machine", "default") for w in words):
        return None
    machine = "default"
    for i, w in enumerate(words[:-1]):
        if w == "machine":
            machine = words[i + 1]
        elif w == "password" and not _REFERENCE.match(words[i + 1]):
            return machine
    return None


def value_finding(value: str) -> Optional[str]:
    """Why `value` is a credential whatever its name: a token's shape, a URL query credential, a
    `.netrc` password."""
    if shape := shape_of(value):
        return f"holds {shape}"
    if (param := query_credential(value)) is not None:
        return f"holds a URL with a credential in its query (`{param}=`)"
    if (machine := netrc_password(value)) is not None:
        return f"holds a .netrc `password` for {machine}"
    return None


def _token_only(name: str) -> bool:
    n = camel_to_snake(name)
    return bool(_TOKEN_ONLY.search(n)) and not _SECRET_NAME.search(_TOKEN_ONLY.sub("", n))


def finding(name: str, value: Any, trust_secrets: bool = False) -> Optional[str]:
    """Why `name: value` is a credential in clear, or None (`trust_secrets`: a Pulumi secret is not)."""
    if not isinstance(value, str) or value == "" or (trust_secrets and is_secret(value)) or is_unknown(value):
        return None
    if why := value_finding(value):
        return why
    if registry_auth(name, value):
        return "holds a registry credential (base64 `user:password` under `auth`)"
    v = value.strip()
    if secret_name(name) and not _BENIGN_VALUE.match(v) and not (_NUMBER.match(v) and _token_only(name)):
        return f"is named like a credential ({name}) and holds a literal"
    return None


def looks_secret(name: str, value: Any) -> bool:
    return finding(name, value) is not None


def _read(container: Any, key: Any) -> tuple[bool, Any]:
    """(known, value): a value unknown during preview is computed, never a literal in the program."""
    try:
        return True, container[key]
    except UnknownValueError:
        return False, None


_LINE = re.compile(r"""^\s*(?:export\s+)?["']?([A-Za-z_][\w.-]*)["']?\s*[:=]\s*(?:"([^"]+)"|'([^']+)'|([A-Za-z0-9+/=._~-]+)\s*(?:[#;].*)?$)""")
"""`name = "value"`, `name: 'value'` or `name=value` with a bare token value; an expression (code
such as `token = f.read()`) is not a literal."""


def _embedded(path: str, text: str, trust: bool) -> Iterator[tuple[str, str]]:
    """A multi-line string holding a config file (YAML, JSON or `key = value` lines)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        doc = None
    if isinstance(doc, (Mapping, list)):
        yield from scan(doc, path, trust)
        return
    for i, line in enumerate(text.splitlines()):
        m = _LINE.match(line)
        if m and (why := finding(m.group(1), next(g for g in m.groups()[1:] if g is not None), trust)):
            yield f"{path} line {i + 1}", why


def _flags(path: str, argv: list[str], trust: bool) -> Iterator[tuple[str, str]]:
    for i, arg in enumerate(argv):
        if arg.startswith("--") and "=" in arg:
            name, value = arg[2:].split("=", 1)
        elif arg.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            name, value = arg[2:], argv[i + 1]
        else:
            continue
        if secret_name(name.replace("-", "_")) and not re.fullmatch(r"\$\(?\{?[A-Za-z_][A-Za-z0-9_]*\}?\)?", value):
            if why := finding(name.replace("-", "_"), value, trust):
                yield f"{path}[{i}]", why


def scan(tree: Any, path: str = "", trust_secrets: bool = False) -> Iterator[tuple[str, str]]:
    """(path, why) for every credential in clear in `tree` (Helm values, a container, ConfigMap data).

    `trust_secrets`: a Pulumi secret is not in clear. True for Helm values (encrypted in the state; the
    chart decides where a value lands, kube-prometheus-stack renders `alertmanager.config` into a
    Secret); False for a pod spec or a ConfigMap, which anyone who can read the object reads in clear."""
    trust = trust_secrets
    if isinstance(tree, Mapping):
        keys = list(tree)
        if "name" in keys and "value" in keys:  # env, httpHeaders: {name, value}
            known_n, n = _read(tree, "name")
            known_v, v = _read(tree, "value")
            if known_n and known_v and isinstance(v, str) and (why := finding(str(n), v, trust)):
                yield f"{path}[{n}]", why
        for k in keys:
            if k in REFERENCE_KEYS or (k == "value" and "name" in keys):
                continue
            known, v = _read(tree, k)
            if not known or (trust and is_secret(v)):
                continue
            sub = f"{path}.{k}" if path else str(k)
            if isinstance(v, str):
                if key_reference(str(k), v, tree):
                    continue
                if why := finding(str(k), v, trust):
                    yield sub, why
                elif "\n" in v.strip() or v.lstrip().startswith(("{", "[")):  # a config file, or one line of JSON
                    yield from _embedded(sub, v, trust)
            else:
                yield from scan(v, sub, trust)
    elif is_seq(tree):
        items = [_read(tree, i) for i in range(len(tree))]
        strings = [v for known, v in items if known and isinstance(v, str)]
        if strings and len(strings) == len(items):
            yield from _flags(path, strings, trust)
        for i, (known, v) in enumerate(items):
            if not known or (trust and is_secret(v)):
                continue
            if isinstance(v, str):
                if why := value_finding(v):
                    yield f"{path}[{i}]", why
            else:
                yield from scan(v, f"{path}[{i}]", trust)
