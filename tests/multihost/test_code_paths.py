"""The user's modules beside the config, imported by every worker of both hosts."""

import subprocess

from tests.config.test_code_paths import imported_by, write_project
from tests.multihost.test_multinode import _env, _shoal

PORT = 29640


def test_workers_on_both_hosts_import_the_modules_beside_the_config(make_hosts, tmp_path):
    hosts = make_hosts(2)
    config = write_project(tmp_path / "project")
    elsewhere, marks = tmp_path / "elsewhere", tmp_path / "marks"
    elsewhere.mkdir()
    marks.mkdir()
    nodes = [hosts.popen(r, _shoal("train", "--config", str(config), "--nproc-per-node", "2",
                                   "--nnodes", "2", "--node-rank", str(r),
                                   "--master-addr", hosts.addr(0), "--master-port", str(PORT),
                                   "--hang-timeout", "60", f"run.dir={tmp_path / 'run'}"),
                         cwd=elsewhere, env={**_env(), "MARKS": str(marks)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outputs = [node.communicate(timeout=150)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    # Each host's launcher checks the builders, and its two workers build from them.
    for module in ("mymodel", "mydata", "myloss"):
        assert len(imported_by(marks, module)) == 6, (module, sorted(marks.iterdir()))
    assert (tmp_path / "run" / "metrics.json").is_file()
