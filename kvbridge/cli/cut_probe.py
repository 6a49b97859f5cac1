"""`kvbridge cut-probe`: where this machine's restores may end, measured once and kept (kvbridge.engine.cut_verdicts)."""
from __future__ import annotations

from kvbridge.models import cut_probe
from kvbridge.cli.command import Command

COMMAND = Command("cut-probe", "measure where a restore may end for the configured model, build and CPU (--save keeps it)",
                  cut_probe.run, cut_probe.add_arguments)
