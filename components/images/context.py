"""What pulumi-docker-build hashes of a build context, byte for byte, so the tag we push can never
diverge from what makes the provider rebuild.

pulumi-docker-build v0.0.22 (`requirements.txt`) decides whether an `Image` is rebuilt (and pushed)
by comparing `contextHash` (`provider/internal/image.go`, `Image.Diff`: `hash != olds.ContextHash`),
computed by `hashBuildContext` in `provider/internal/context.go`:

1. the ignore file is `<Dockerfile>.dockerignore`, else `<context>/.dockerignore`
   (`getIgnorePatterns`), parsed by moby/patternmatcher v0.6.1 `ignorefile.ReadAll` (BOM stripped,
   `#` lines skipped, whitespace trimmed, `filepath.Clean`, a leading `/` dropped, `!` kept);
2. SHA-256 over the Dockerfile's bytes (`hashDockerfile`, its name is not hashed), then over every
   file of the context that the ignore patterns leave (`rootFS` = tonistiigi/fsutil `NewFS` +
   `NewFilterFS` with `ExcludePatterns`, walked by `filepath.WalkDir`: lexical order per directory,
   symlinks not followed), each as its content, its slash path, then Go's `FileMode.String()` of its
   lstat mode (`hashFile`): modes count;
3. only regular files and symlinks are hashed; a symlink is hashed through its target's content
   (`os.Open` follows it) and a symlink to a directory is skipped (`EISDIR`).

fsutil (v0.0.0-20260609091201-0257b3308df4, `filter.go` `filterFS.Walk`) matches each path with
`PatternMatcher.MatchesUsingParentResults`, so what matched a directory holds for everything under
it, and skips an excluded directory outright when no exception pattern could reach inside it.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

_ESCAPED = set(".+()|{}$")
"""patternmatcher's `shouldEscape`: regexp metacharacters that are not filepath.Match syntax."""


def read_ignore_file(text: bytes) -> list[str]:
    """moby/patternmatcher v0.6.1 `ignorefile.ReadAll`."""
    out = []
    for i, raw in enumerate(text.splitlines()):
        if i == 0:
            raw = raw.removeprefix(b"\xef\xbb\xbf")
        line = raw.decode()
        if line.startswith("#"):
            continue
        line = line.strip()
        if not line:
            continue
        invert = line[0] == "!"
        if invert:
            line = line[1:].strip()
        if line:
            line = os.path.normpath(line) if line != "/" else "/"
            if line.startswith("//"):  # filepath.Clean folds leading slashes, normpath keeps two
                line = "/" + line.lstrip("/")
            if len(line) > 1 and line[0] == "/":
                line = line[1:]
        out.append("!" + line if invert else line)
    return out


def ignore_patterns(context: Path, dockerfile: Path) -> list[str]:
    """`getIgnorePatterns`: `<Dockerfile>.dockerignore` wins over `<context>/.dockerignore`."""
    for candidate in (Path(str(dockerfile) + ".dockerignore"), context / ".dockerignore"):
        if candidate.is_file():
            return read_ignore_file(candidate.read_bytes())
    return []


@dataclass
class Pattern:
    """patternmatcher's `Pattern` (`compile` and `match`, with `/` as the separator)."""

    text: str
    exclusion: bool = False
    kind: str = "exact"
    regexp: Optional[re.Pattern[str]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        reg, kind, p, i = "^", "exact", self.text, 0
        while i < len(p):
            ch = p[i]
            if ch == "*":
                if i + 1 < len(p) and p[i + 1] == "*":
                    first = i == 0
                    i += 2
                    if i < len(p) and p[i] == "/":
                        i += 1
                    if i >= len(p):
                        if kind == "exact":
                            kind = "prefix"
                        else:
                            reg += ".*"
                            kind = "regexp"
                    else:
                        reg += "(.*/)?"
                        kind = "regexp"
                    if first:
                        kind = "suffix"
                    continue
                reg += "[^/]*"
                kind = "regexp"
            elif ch == "?":
                reg += "[^/]"
                kind = "regexp"
            elif ch in _ESCAPED:
                reg += "\\" + ch
            elif ch == "\\":
                if i + 1 < len(p):
                    reg += "\\" + p[i + 1]
                    i += 1
                    kind = "regexp"
                else:
                    reg += "\\"  # a trailing backslash stays as is (and escapes the closing `$`)
            elif ch in "[]":
                reg += ch
                kind = "regexp"
            else:
                reg += ch  # `^` too: an anchor mid-pattern in Go's regexp and Python's alike
            i += 1
        self.kind = kind
        if kind == "regexp":
            self.regexp = re.compile(reg + "$")

    def match(self, path: str) -> bool:
        if self.kind == "exact":
            return path == self.text
        if self.kind == "prefix":
            return path.startswith(self.text[:-2])
        if self.kind == "suffix":
            suffix = self.text[2:]
            return path.endswith(suffix) or (suffix[:1] == "/" and path == suffix[1:])
        assert self.regexp is not None
        return self.regexp.match(path) is not None


class PatternMatcher:
    """patternmatcher v0.6.1 `New` and `MatchesUsingParentResults`."""

    def __init__(self, patterns: list[str]):
        self.patterns: list[Pattern] = []
        for p in patterns:
            p = p.strip()
            if not p:
                continue
            p = os.path.normpath(p)
            exclusion = p[0] == "!"
            if exclusion:
                if len(p) == 1:
                    raise ValueError('illegal exclusion pattern: "!"')
                p = p[1:]
            self.patterns.append(Pattern(p, exclusion))
        self.exclusions = any(p.exclusion for p in self.patterns)

    def matches(self, path: str, parent: Optional[list[bool]]) -> tuple[bool, list[bool]]:
        matched, info = False, [False] * len(self.patterns)
        for i, pattern in enumerate(self.patterns):
            match = bool(parent) and parent[i]
            if not match:
                if pattern.exclusion != matched:
                    continue
                match = pattern.match(path)
                if not match and not parent and "/" in path:
                    dirs = path.split("/")[:-1]
                    match = any(pattern.match("/".join(dirs[: j + 1])) for j in range(len(dirs)))
            info[i] = match
            if match:
                matched = not pattern.exclusion
        return matched, info

    def can_skip(self, directory: str) -> bool:
        """fsutil's shortcut for an excluded directory: no exception pattern could re-include
        anything inside it (only when every exception is a plain prefix)."""
        exceptions = [p for p in self.patterns if p.exclusion]
        if any(set(_without_trailing_glob(p.text)) & set("*[]?^\\") for p in exceptions):
            return False
        return not any((_without_trailing_glob(p.text) + "/").startswith(directory + "/") for p in exceptions)


def _without_trailing_glob(p: str) -> str:
    return p.removesuffix("/**").removesuffix("/*")


def go_file_mode(mode: int) -> str:
    """Go's `os.FileMode.String()` of what `os.Lstat` reports for `mode` (st_mode), as fsutil's
    `mkstat` records it (`uint32(fi.Mode())`, socket bit cleared)."""
    bits = {  # Go's FileMode type bits, "dalTLDpSugct?" from bit 31 down
        "d": stat.S_ISDIR(mode), "L": stat.S_ISLNK(mode), "D": stat.S_ISBLK(mode) or stat.S_ISCHR(mode),
        "p": stat.S_ISFIFO(mode), "u": bool(mode & stat.S_ISUID), "g": bool(mode & stat.S_ISGID),
        "c": stat.S_ISCHR(mode), "t": bool(mode & stat.S_ISVTX),
    }
    out = "".join(c for c in "dalTLDpSugct?" if bits.get(c))
    rwx = "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return (out or "-") + rwx


def context_files(context: Path, dockerfile: Optional[Path] = None) -> list[tuple[str, Path, int]]:
    """(slash path, file, lstat mode) of every file the provider hashes, in its order."""
    matcher = PatternMatcher(ignore_patterns(context, dockerfile or context / "Dockerfile"))
    root = Path(os.path.realpath(context))
    out: list[tuple[str, Path, int]] = []

    def walk(directory: Path, rel: str, parent: Optional[list[bool]]) -> None:
        for name in sorted(os.listdir(directory), key=lambda n: n.encode()):
            path = directory / name
            relpath = f"{rel}/{name}" if rel else name
            st = path.lstat()
            excluded, info = matcher.matches(relpath, parent) if matcher.patterns else (False, [])
            if stat.S_ISDIR(st.st_mode):
                if excluded and not matcher.exclusions:
                    continue
                if excluded and matcher.can_skip(relpath):
                    continue
                walk(path, relpath, info)
            elif not excluded and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                if stat.S_ISLNK(st.st_mode) and path.is_dir():
                    continue  # hashFile: EISDIR, skipped
                out.append((relpath, path, st.st_mode))

    walk(root, "", None)
    return out


def provider_context_hash(context: Path, dockerfile: Optional[Path] = None) -> str:
    """`hashBuildContext(context, dockerfile, nil)` of pulumi-docker-build v0.0.22."""
    dockerfile = dockerfile or context / "Dockerfile"
    h = hashlib.sha256(dockerfile.read_bytes())
    for relpath, path, mode in context_files(context, dockerfile):
        try:
            h.update(path.read_bytes())
        except OSError as e:  # the provider fails the same way: "could not open", and no diff
            raise ValueError(f"{context}: cannot read {relpath} ({e}); a build context holds no dangling links") from e
        h.update(relpath.encode() + go_file_mode(mode).encode())
    return h.hexdigest()
