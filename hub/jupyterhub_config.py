"""JupyterHub for a Decode Lab class on one Linux machine (README, "A hosted class").

    sudo .venv/bin/jupyterhub -f hub/jupyterhub_config.py      # from the repository root, as root

Every user is a local account in the Unix group `decodelab` (PAM logs them in); each gets a JupyterLab server of their own,
started by the hub as that user from this repository's .venv (LocalProcessSpawner), in their home
folder. Students see nbgrader's assignment list (fetch, validate, submit); members of the group
`instructors` also get formgrader and the create-assignment toolbar. The exchange and the course
id come from /etc/jupyter/nbgrader_config.py (README), which every user's server reads.

The model cache is shared and read-only: root prepares SmolLM2 once into DECODELAB_CACHE
(`DECODELAB_CACHE=/srv/decodelab/cache .venv/bin/python -m decodelab prepare`), and every
kernel reads it there instead of converting its own 515 MB copy in each home.

tests/test_hub.py loads this file and overrides only what a test must (ports, a dummy
authenticator with a password, the exchange folder, its two users).
"""

import os
import sys
from pathlib import Path

c = get_config()  # noqa: F821 - JupyterHub's config loader defines it

HERE = Path(__file__).resolve().parent
CACHE = os.environ.get("DECODELAB_CACHE", "/srv/decodelab/cache")

# ---- who logs in: the local accounts in the Unix group `decodelab`, through PAM (never root);
# add instructors' names to the hub's group `instructors` below.
c.JupyterHub.authenticator_class = "pam"
c.PAMAuthenticator.allowed_groups = {"decodelab"}
c.Authenticator.blocked_users = {"root"}
c.JupyterHub.load_groups = {"instructors": {"users": []}}

# ---- where: behind a TLS-terminating reverse proxy in a real class; the hub's own proxy is
# configurable-http-proxy from npm (`make setup` puts it in .venv/bin).
c.JupyterHub.bind_url = "http://127.0.0.1:8000"
c.ConfigurableHTTPProxy.command = [str(Path(sys.prefix) / "bin" / "configurable-http-proxy")]

# ---- each user's server: this venv's Python (the course's packages, decodelab editable), JupyterLab.
c.JupyterHub.spawner_class = "localprocess"
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.Spawner.environment = {
    "DECODELAB_CACHE": CACHE,  # the shared, read-only SmolLM2 (prepared once by root)
    "OMP_WAIT_POLICY": "PASSIVE",  # spinning OpenMP threads slow every neighbour's decode
    "OMP_NUM_THREADS": "2",  # torch's threads per kernel; the machine's cores are shared by the class
    "JUPYTER_CONFIG_PATH": "",  # the role's folder is put first by pre_spawn_hook
}
# What a kernel needs at its peak (bench/results/kernel_memory.json, README table: 10_capstone_engine,
# about 4,070 MiB in full mode), with room for the JupyterLab server beside it. LocalProcessSpawner
# only passes it on (MEM_LIMIT); systemdspawner or a container spawner enforces it.
c.Spawner.mem_limit = "4608M"


def pre_spawn_hook(spawner):
    """Students get the assignment list only; instructors every nbgrader extension."""
    role = "instructor" if any(group.name == "instructors" for group in spawner.user.groups) else "student"
    paths = [str(HERE / role), *filter(None, spawner.environment.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep))]
    spawner.environment = {**spawner.environment, "JUPYTER_CONFIG_PATH": os.pathsep.join(paths)}


c.Spawner.pre_spawn_hook = pre_spawn_hook
