"""Imported by Python at the start of every process whose PYTHONPATH holds this folder (tools/fsdp_conformance/run.py
puts it there): the pytest process and each rank that PyTorch's test harness spawns. It turns the harness patches of
fsdp_conformance_shim on when run.py asked for them; otherwise it does nothing."""

import os

if os.environ.get("FSDP_CONFORMANCE") == "1":
    import fsdp_conformance_shim

    fsdp_conformance_shim.install()
