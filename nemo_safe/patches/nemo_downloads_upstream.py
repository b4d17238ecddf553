# ruff: noqa: UP006, UP007, UP035, E722, RUF010  (NeMo's idiom: typing, its bare except, str() in f-strings)
"""What the upstream pull request puts into ``nemo/utils/cloud.py`` (and uses in ``megatron_utils.py``), verbatim.

NeMo writes its downloads straight into their final names: ``maybe_download_from_cloud``
``urlretrieve``s into the cached ``.nemo`` file and re-uses any file it finds there, so a
process that starts while another downloads re-uses a partial file; ``megatron_utils._download``
downloads every process into the same ``path + ".tmp"`` and moves it, so processes that
construct a model before ``torch.distributed`` exists die with ``FileNotFoundError``
(NVIDIA/NeMo#12420). The pull request downloads through a temporary name of the calling
process and publishes it with ``os.replace``: the final name holds a complete file or none.

The overlay (:mod:`nemo_safe.patches.nemo_downloads`) calls the same function, with the target
module's globals, inside a single flight (one download per destination across processes).
"""

import os
import urllib.request
import uuid
from pathlib import Path
from time import sleep
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # found in nemo.utils.cloud and megatron_utils, where these functions run
    import torch
    from nemo.utils import logging

    MEGATRON_CACHE = ""


def _partial_path(path: str) -> str:
    """A temporary name next to ``path`` (the same directory: ``os.replace`` is atomic), hidden, never a model's."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name[:200]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")


def download_atomically(url: str, path: str) -> None:
    """Download ``url`` to ``path`` through a temporary name, so that ``path`` is complete or absent: a process that
    finds it never reads a partial download, and concurrent downloads never share a file."""
    partial = _partial_path(path)
    try:
        urllib.request.urlretrieve(url, partial)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def maybe_download_from_cloud(url, filename, subfolder=None, cache_dir=None, refresh_cache=False) -> str:
    """
    Helper function to download pre-trained weights from the cloud
    Args:
        url: (str) URL of storage
        filename: (str) what to download. The request will be issued to url/filename
        subfolder: (str) subfolder within cache_dir. The file will be stored in cache_dir/subfolder. Subfolder can
            be empty
        cache_dir: (str) a cache directory where to download. If not present, this function will attempt to create it.
            If None (default), then it will be $HOME/.cache/torch/NeMo
        refresh_cache: (bool) if True and cached file is present, it will be re-fetched and replaced

    Returns:
        If successful - absolute local path to the downloaded file
        else - empty string
    """
    # try:
    if cache_dir is None:
        cache_location = Path.joinpath(Path.home(), ".cache/torch/NeMo")
    else:
        cache_location = cache_dir
    if subfolder is not None:
        destination = Path.joinpath(cache_location, subfolder)
    else:
        destination = cache_location

    if not os.path.exists(destination):
        os.makedirs(destination, exist_ok=True)

    destination_file = Path.joinpath(destination, filename)

    if os.path.exists(destination_file):
        logging.info(f"Found existing object {destination_file}.")
        if refresh_cache:
            # the new download replaces it whole: a process still reading it keeps the old file
            logging.info("Asked to refresh the cache.")
        else:
            logging.info(f"Re-using file from: {destination_file}")
            return str(destination_file)
    # download file
    wget_uri = url + filename
    logging.info(f"Downloading from: {wget_uri} to {str(destination_file)}")
    # NGC links do not work everytime so we try and wait
    i = 0
    max_attempts = 3
    while i < max_attempts:
        i += 1
        try:
            download_atomically(wget_uri, str(destination_file))
            if os.path.exists(destination_file):
                return destination_file
            else:
                return ""
        except:
            logging.info(f"Download from cloud failed. Attempt {i} of {max_attempts}")
            sleep(0.05)
            continue
    raise ValueError("Not able to download url right now, please try again.")


def _download(path: str, url: str):
    """
    Gets a file from cache or downloads it

    Args:
        path: path to the file in cache
        url: url to the file
    Returns:
        path: path to the file in cache
    """
    if url is None:
        return None

    if (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0) and not os.path.exists(path):
        os.makedirs(MEGATRON_CACHE, exist_ok=True)
        logging.info(f"Downloading from {url} to {path}")
        download_atomically(url, path)
    # wait until the master process downloads the file and writes it to the cache dir
    if torch.distributed.is_initialized():
        torch.distributed.barrier()

    return path
