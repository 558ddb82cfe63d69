"""A Ray driver that a job's command started stays the job's after a restart (issue 32, item 19):
its `job_id` and `driver_info` are stored with the run as it ends, so a server restarted on a
new Ray (the embedded default: the new Ray's job table has never heard of the driver) answers
them as before. Real servers, real Ray, a real driver."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from tests.support.restarts import embedded_server

DRIVER = (
    "import os, ray; ray.init(); "
    "print('JOB_ID', ray.get_runtime_context().get_job_id(), os.getpid(), flush=True); "
    "ray.shutdown()"
)


def test_a_drivers_job_id_and_driver_info_survive_a_restart_on_a_new_ray(
    tmp_path: Path,
    ray_tmpdir: Path,
) -> None:
    server = embedded_server(tmp_path, ray_tmpdir)
    server.start()
    try:
        job_id = server.submit(entrypoint=f"{sys.executable} -c {shlex.quote(DRIVER)}")
        ended = server.wait_status(job_id, "SUCCEEDED", "FAILED", "STOPPED")
        logs = server.logs(job_id)
        assert ended["status"] == "SUCCEEDED", logs
        (line,) = [line for line in logs.splitlines() if line.startswith("JOB_ID ")]
        _, ray_job_id, driver_pid = line.split()
        # Found as Ray's server finds it, in the job table of the Ray it ran on.
        assert ended["job_id"] == ray_job_id
        driver_info = ended["driver_info"]
        assert driver_info["id"] == ray_job_id
        assert driver_info["pid"] == driver_pid

        server.stop()
        server.start()  # a new embedded Ray, with a job table of its own
        again = server.job(job_id)
        assert again["status"] == "SUCCEEDED"
        assert again["job_id"] == ray_job_id
        assert again["driver_info"] == driver_info
        listed = server.listed()[job_id]
        assert listed["job_id"] == ray_job_id
        assert listed["driver_info"] == driver_info
    finally:
        server.stop()
