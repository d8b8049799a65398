"""docs/operations.md shows the pod tests/test_pod_integration.py runs, byte for byte."""

from __future__ import annotations

import re

from conftest import ROOT


def test_the_operations_guide_shows_the_pod_file_the_pod_test_runs():
    doc = (ROOT / "docs" / "operations.md").read_text()
    pod = (ROOT / "docs" / "k8s" / "agent-pod.yaml").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```$", doc, re.M | re.S)
    assert pod in blocks, "docs/operations.md must hold docs/k8s/agent-pod.yaml whole in a ```yaml block"
