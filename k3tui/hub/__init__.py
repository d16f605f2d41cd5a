"""Resumable, verified downloads: Hub metadata via huggingface_hub, bytes via our own loop.

    snap = fetch_snapshot("moonshotai/Kimi-K3", "main", include=None)
    plan = plan_download(snap, target); plan.refuse_if_short()
    result = download(snap, target, workers=8, on_progress=callback)   # connections
"""

from k3tui.hub.progress import ProgressEvent
from k3tui.hub.metadata import RemoteFile, RepoSnapshot, fetch_snapshot, hub_endpoint, hub_token
from k3tui.hub.sync import DownloadPlan, DownloadResult, download, plan_download
from k3tui.hub.transfer import CHUNK_BYTES, Options

__all__ = ["CHUNK_BYTES", "DownloadPlan", "DownloadResult", "Options", "ProgressEvent",
           "RemoteFile", "RepoSnapshot", "download", "fetch_snapshot", "hub_endpoint",
           "hub_token", "plan_download"]
