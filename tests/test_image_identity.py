"""An image's tag is exactly what pulumi-docker-build hashes of its context (components/images/context.py,
a port of `hashBuildContext`, pulumi/pulumi-docker-build provider/internal/context.go at v0.0.22).

The cases mirror the provider's own `context_test.go` at v0.0.22 (TestHashIgnoresFile,
TestHashIgnoresWildcards, TestHashIgnoresDockerfileOutsideDirMove, TestHashRenamingMatters,
TestHashFilemodeMatters, TestIgnoreIrregularFiles, the `.dockerignore` precedence of
`getIgnorePatterns`), on contexts made here; the byte layout is pinned by a hand-computed hash.
Then the project's own contexts: a second clone, `make test`'s leftovers and a revert give the tag
the first clone pushed."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from components.images.context import PatternMatcher, context_files, go_file_mode, provider_context_hash, read_ignore_file
from components.images.specs import SOURCES, image_tag

ROOT = Path(__file__).resolve().parents[1]
AMD64 = ["linux/amd64"]


def make(root: Path, files: dict[str, str], mode: int = 0o644) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        p.chmod(mode)
    return root


def test_the_byte_layout_is_the_providers():
    """Dockerfile bytes (no name), then per file: content, slash path, Go FileMode string."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        ctx = make(Path(d), {"Dockerfile": "FROM scratch\n", "a/b.txt": "B", "c.txt": "C"})
        want = hashlib.sha256(b"FROM scratch\n" + b"FROM scratch\nDockerfile-rw-r--r--" + b"Ba/b.txt-rw-r--r--" + b"Cc.txt-rw-r--r--")
        assert provider_context_hash(ctx) == want.hexdigest()


def test_go_file_mode_strings():
    """Go's os.FileMode.String() ("dalTLDpSugct?" type letters, then rwx) of lstat modes."""
    import stat

    assert go_file_mode(stat.S_IFREG | 0o644) == "-rw-r--r--"
    assert go_file_mode(stat.S_IFREG | 0o755) == "-rwxr-xr-x"
    assert go_file_mode(stat.S_IFLNK | 0o777) == "Lrwxrwxrwx"
    assert go_file_mode(stat.S_IFREG | stat.S_ISUID | 0o755) == "urwxr-xr-x"
    assert go_file_mode(stat.S_IFDIR | 0o755) == "drwxr-xr-x"


def test_an_ignored_file_changes_nothing(tmp_path):
    base = make(tmp_path / "a", {"Dockerfile": "FROM x\n", "foo.txt": "f", "bar/app.js": "a"})
    more = make(tmp_path / "b", {"Dockerfile": "FROM x\n", "foo.txt": "f", "bar/app.js": "a", "ignored.txt": "i",
                                 "bar/ignored.js": "i", ".dockerignore": ".dockerignore\nignored.txt\nbar/ignored.js\n"})
    assert provider_context_hash(base) == provider_context_hash(more)


def test_wildcard_exceptions(tmp_path):
    """`*` then `!projects/*/src`: only the src folders count (moby/moby#30018)."""
    files = {"Dockerfile": "FROM x\n", ".dockerignore": "# all\n*\n!projects/*/src\n",
             "projects/foo/src/app.js": "1", "projects/foo/dist/app.js": "1"}
    base = provider_context_hash(make(tmp_path / "a", files))
    assert provider_context_hash(make(tmp_path / "b", {**files, "projects/foo/dist/app.js": "2"})) == base
    assert provider_context_hash(make(tmp_path / "c", {**files, "projects/foo/src/app.js": "2"})) != base
    assert [f[0] for f in context_files(tmp_path / "a")] == ["projects/foo/src/app.js"]


def test_the_dockerfile_is_hashed_by_content_not_place(tmp_path):
    app = make(tmp_path / "app", {"foo.sh": "echo"})
    one = make(tmp_path / "one", {"x.Dockerfile": "FROM y\n"}) / "x.Dockerfile"
    two = make(tmp_path / "two", {"y.Dockerfile": "FROM y\n"}) / "y.Dockerfile"
    assert provider_context_hash(app, one) == provider_context_hash(app, two)


@pytest.mark.parametrize("change", ["rename", "chmod", "content", "dockerfile"])
def test_what_changes_the_hash(tmp_path, change):
    files = {"Dockerfile": "FROM x\n", "foo.a.txt": "x"}
    base = provider_context_hash(make(tmp_path / "a", files))
    ctx = make(tmp_path / "b", files)
    if change == "rename":
        (ctx / "foo.a.txt").rename(ctx / "foo.b.txt")
    elif change == "chmod":
        (ctx / "foo.a.txt").chmod(0o755)
    elif change == "content":
        (ctx / "foo.a.txt").write_text("y")
    else:
        (ctx / "Dockerfile").write_text("FROM z\n")
    assert provider_context_hash(ctx) != base


def test_irregular_files_and_links_to_folders_are_skipped_and_dangling_links_refused(tmp_path):
    files = {"Dockerfile": "FROM x\n", "d/f.txt": "x"}
    base = provider_context_hash(make(tmp_path / "a", files))
    ctx = make(tmp_path / "b", files)
    os.mkfifo(ctx / "pipe")
    (ctx / "link-to-dir").symlink_to("d")
    assert provider_context_hash(ctx) == base
    (ctx / "link-to-file").symlink_to("d/f.txt")
    assert "link-to-file" in [f[0] for f in context_files(ctx)] and provider_context_hash(ctx) != base
    (ctx / "dangling").symlink_to("nowhere")
    with pytest.raises(ValueError, match="dangling"):
        provider_context_hash(ctx)


def test_the_dockerfiles_own_ignore_file_wins(tmp_path):
    ctx = make(tmp_path, {"Dockerfile": "FROM x\n", "a.txt": "a", "b.txt": "b", ".dockerignore": "a.txt\n",
                          "Dockerfile.dockerignore": "b.txt\n"})
    assert [f[0] for f in context_files(ctx)] == [".dockerignore", "Dockerfile", "Dockerfile.dockerignore", "a.txt"]


def test_walk_order_is_per_directory():
    """filepath.WalkDir: `a/b` (inside `a`) before `a.txt`, unlike a sort of whole paths."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        ctx = make(Path(d), {"Dockerfile": "FROM x\n", "a.txt": "1", "a/b": "2"})
        assert [f[0] for f in context_files(ctx)] == ["Dockerfile", "a/b", "a.txt"]


def test_ignore_file_syntax():
    """ignorefile.ReadAll: comments, blanks, `!`, cleaned paths, leading `/` dropped; patterns as
    patternmatcher matches them (`**`, `*` within a segment, parent folders)."""
    assert read_ignore_file(b"\xef\xbb\xbf# c\n\n /build/ \n! keep/../x\n**/__pycache__\n") == ["build", "!x", "**/__pycache__"]
    m = PatternMatcher(["**/__pycache__", "*.pyc", "build", "!build/keep"])
    assert m.matches("agent/__pycache__", None)[0] and m.matches("__pycache__", None)[0]
    assert m.matches("x.pyc", None)[0] and not m.matches("agent/x.pyc", None)[0]
    assert m.matches("build/a.o", None)[0] and not m.matches("build/keep", None)[0]


# --- the project's own contexts ----------------------------------------------------------------


def second_clone(dest: Path) -> Path:
    """The images' contexts as `git clone` lays them out (tracked files, 0644 or 0755 by the exec
    bit git records), with the working tree's content."""
    listed = subprocess.run(["git", "ls-files", "-s", "-z", *(s.context for s in SOURCES)], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for entry in filter(None, listed):
        meta, rel = entry.split("\t", 1)
        if not (ROOT / rel).exists():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, target)
        target.chmod(0o755 if meta.split()[0] == "100755" else 0o644)
    return dest


def test_a_second_clone_with_make_tests_leftovers_gets_the_same_tags(tmp_path):
    clone = second_clone(tmp_path / "clone")
    want = {s.role: image_tag(s, AMD64, clone) for s in SOURCES}
    # What `make test` and a local build leave in the contexts: bytecode, compiled objects, caches.
    make(clone, {"bpf/build/sockredir.bpf.o": "obj", "bpf/agent/__pycache__/config.cpython-311.pyc": "pyc",
                 "runtime/__pycache__/drain.cpython-311.pyc": "pyc", "runtime/.pytest_cache/v": "c", "bpf/x.pyc": "p"})
    assert {s.role: image_tag(s, AMD64, clone) for s in SOURCES} == want
    other = second_clone(tmp_path / "other")
    assert {s.role: image_tag(s, AMD64, other) for s in SOURCES} == want


def test_a_revert_gets_the_tag_it_had(tmp_path):
    clone = second_clone(tmp_path / "clone")
    src = next(s for s in SOURCES if s.role == "runtime")
    before = image_tag(src, AMD64, clone)
    drain = clone / "runtime" / "drain.py"
    text = drain.read_text()
    drain.write_text(text + "\n# a change\n")
    assert image_tag(src, AMD64, clone) != before
    drain.write_text(text)
    assert image_tag(src, AMD64, clone) == before
    assert image_tag(src, ["linux/amd64", "linux/arm64"], clone) != before, "another platform set is another build"


@pytest.mark.parametrize("src", SOURCES, ids=[s.role for s in SOURCES])
def test_what_the_tag_covers_is_what_the_dockerfile_copies(src):
    """Every file the Dockerfile's COPY lines read is in the hashed context (a `.dockerignore`
    entry that dropped one would build an image the tag does not name)."""
    hashed = {rel for rel, _, _ in context_files(ROOT / src.context)}
    copies = [line.split()[1:-1] for line in (ROOT / src.context / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") and "--from" not in line]
    for sources in copies:
        for pattern in sources:
            matched = [rel for rel in hashed if Path(rel).match(pattern) or rel.startswith(pattern.rstrip("/") + "/")]
            assert matched, f"{src.context}/Dockerfile COPY {pattern}: nothing of it is in the hashed context"


def test_the_tag_changes_exactly_when_the_providers_hash_does(tmp_path):
    """Whatever happens to a context, the pushed tag moves with pulumi-docker-build's contextHash:
    a rebuild (hash changed) always pushes a new tag, and an unchanged hash keeps the tag."""
    clone = second_clone(tmp_path / "clone")
    src = next(s for s in SOURCES if s.role == "agent")
    ctx = clone / src.context

    def state():
        return provider_context_hash(ctx), image_tag(src, AMD64, clone)

    mutations = {
        "a wheel for an offline build": lambda: (ctx / "wheels" / "x-1.0-py3-none-any.whl").write_text("w"),
        "an executable bit": lambda: (ctx / "Makefile").chmod(0o755),
        "a group-writable file (umask 002)": lambda: (ctx / "agent" / "config.py").chmod(0o664),
        "bytecode": lambda: make(ctx, {"agent/__pycache__/x.pyc": "b"}),
        "compiled objects": lambda: make(ctx, {"build/x.bpf.o": "o"}),
        "a README edit": lambda: (ctx / "README.md").write_text("edited"),
        "a new source file": lambda: make(ctx, {"agent/new.py": "x = 1\n"}),
    }
    for what, mutate in mutations.items():
        before = state()
        mutate()
        after = state()
        assert (after[0] != before[0]) == (after[1] != before[1]), f"{what}: provider hash and tag disagree"
