"""dsv4_jax.source_digest: the digest a result carries to name the code that ran."""

from dsv4_jax.source_digest import source_digest


def test_source_digest_names_the_code(tmp_path):
    """The digest follows each source file's path and content, ignores compiled caches and other files, and does
    not depend on the order the file system lists them in."""
    (tmp_path / "ops").mkdir()
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "ops" / "a.py").write_text("x = 1\n")
    (tmp_path / "kernel.cu").write_text("// k\n")
    first = source_digest(str(tmp_path))
    assert first["files"] == 2
    (tmp_path / "__pycache__" / "a.cpython-313.pyc").write_bytes(b"\0")
    (tmp_path / "notes.txt").write_text("not code")
    assert source_digest(str(tmp_path)) == first
    (tmp_path / "ops" / "a.py").write_text("x = 2\n")
    changed = source_digest(str(tmp_path))
    assert changed["sha256"] != first["sha256"]
    (tmp_path / "ops" / "a.py").write_text("x = 1\n")
    (tmp_path / "ops" / "a.py").rename(tmp_path / "ops" / "b.py")          # same content, another file
    assert source_digest(str(tmp_path))["sha256"] not in (first["sha256"], changed["sha256"])
