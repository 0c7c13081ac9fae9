"""What runs the course, apart from what it teaches.

``launch`` starts a script under torchrun or as one plain process from a notebook,
a test or the shell (with :mod:`.jobs`, :mod:`.failures`, :mod:`.ports`,
:mod:`.loopback`, :mod:`.forked_ranks`, :mod:`.agent_server` and :mod:`.agent_fork`
behind it);
``multinode`` (its nodes' commands built by :mod:`.multinode_commands`, their logs read back
by :mod:`.multinode_logs`), ``netns`` and
``slurm`` (with :mod:`.slurm_install` and :mod:`.slurm_jobs`) launch jobs that span
several nodes; ``cli`` is ``python -m ddp_course``; ``gpu_check`` runs the course on a
GPU machine (its plan in :mod:`.gpu_plan`, its pytest reports in :mod:`.gpu_reports`,
its record and exit status in :mod:`.gpu_summary`, the notebooks' launches read by
:mod:`.launch_scan` and :mod:`.notebook_values`); ``notebook`` holds the helpers every
lesson's cells use; ``script_args`` the flags every script spells one way and the
parser that adds them.
"""
