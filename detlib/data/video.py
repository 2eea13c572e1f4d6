"""Video files for the predict scripts: frames read and drawn frames written with PyAV (FFmpeg), an optional
dependency (`pip install av`, or `pip install detlib[video]`).

A video is predicted frame by frame exactly as the same frames saved as images would be: each decoded frame is
an RGB uint8 array that goes through the evaluation transform, batched `--batch_size` frames at a time in
frame order (the batches of a folder of the frames as image files).
"""

from __future__ import annotations

import os
from fractions import Fraction
from typing import Iterator

import numpy as np

# File name extensions read as videos (lower case).
VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".avi", ".mkv", ".webm", ".mpg", ".mpeg", ".wmv", ".flv", ".ts", ".3gp")
INSTALL_HINT = "pip install av (or pip install 'detlib[video]')"
# Codecs tried in order for the drawn video (.mp4): H.264 plays everywhere; MPEG-4 part 2 is in every FFmpeg build.
OUTPUT_CODECS = ("libx264", "h264", "mpeg4")


def is_video_file(path: str) -> bool:
    return path.lower().endswith(VIDEO_EXTENSIONS)


def av_available() -> bool:
    """True when PyAV is installed (found, not imported)."""
    import importlib.util

    return importlib.util.find_spec("av") is not None


def require_av():
    """The `av` module. Raises ImportError with the install line when PyAV is not installed."""
    try:
        import av
    except ImportError:
        raise ImportError(f"reading videos needs PyAV: {INSTALL_HINT}") from None
    return av


def video_info(path: str) -> dict:
    """{"frames": int or None (when the container does not say), "fps": float, "width", "height"} of the first
    video stream. Raises ValueError naming the file when it holds no readable video stream."""
    v = VideoFrames(path)
    v.close()
    return {"frames": v.declared, "fps": v.fps, "width": v.width, "height": v.height}


def video_frames(path: str) -> "VideoFrames":
    """The frames of a video file (`VideoFrames`: iterate it; afterwards `problem()` says whether every frame came).
    Raises ValueError naming the file when it is not a readable video or holds no video stream."""
    return VideoFrames(path)


class VideoFrames:
    """The frames of a video file's first video stream in display order, once: (index from 0, time in seconds,
    [H, W, 3] uint8 RGB).

    The time is the frame's presentation time from the stream start (index / fps when the container has none).
    A frame that fails to decode ends the iteration there, without raising: `problem()` then says so. The rule for
    damaged videos: one that yields no frame is unreadable (the predict scripts skip it: skipped.txt and the log,
    nothing written for it); one that ends before the frame count its container declares (a truncated file whose
    index is at its start, "faststart"), or whose decoding fails after some frames, has its frames predicted and is
    named in skipped.txt as ended early.

    Attributes: `fps`, `width`, `height`, `declared` (the container's frame count; None when it does not say),
    `decoded` (frames yielded so far).
    Raises:
        ValueError: naming the file, when it cannot be opened as a video or holds no video stream.
    """

    def __init__(self, path: str):
        av = require_av()
        self.path = path
        try:
            self._container = av.open(path)
        except av.FFmpegError as e:
            raise ValueError(f"{path} is not a readable video ({type(e).__name__}: {e})") from None
        if not self._container.streams.video:
            self._container.close()
            raise ValueError(f"{path} holds no video stream")
        self._stream = s = self._container.streams.video[0]
        self.fps = float(s.average_rate or s.guessed_rate or 25)
        self.width, self.height = s.codec_context.width, s.codec_context.height
        self.declared = int(s.frames) or None
        self.decoded = 0
        self._stopped: str | None = None

    def __iter__(self) -> Iterator[tuple[int, float, np.ndarray]]:
        av = require_av()
        stream, start = self._stream, self._stream.start_time or 0
        try:
            for frame in self._container.decode(stream):
                t = float((frame.pts - start) * stream.time_base) if frame.pts is not None else self.decoded / self.fps
                rgb = frame.to_ndarray(format="rgb24")
                self.decoded += 1
                yield self.decoded - 1, t, rgb
        except av.FFmpegError as e:
            self._stopped = f"{type(e).__name__}: {e}"
        finally:
            self._container.close()

    def close(self) -> None:
        self._container.close()

    def problem(self) -> str | None:
        """After the iteration: None when every frame came, else why not, as skipped.txt words it: "no frame could
        be decoded (...)" or "ended early: N of M frames decoded (...)"."""
        why = f" ({self._stopped})" if self._stopped else ""
        if self.decoded == 0:
            return "no frame could be decoded" + (why or (f" (the container declares {self.declared})" if self.declared
                                                          else ""))
        if self._stopped or (self.declared and self.decoded < self.declared):
            of = f" of {self.declared}" if self.declared and self.decoded < self.declared else ""
            return f"ended early: {self.decoded}{of} frames decoded{why or ' (the file is cut short?)'}"
        return None


class VideoWriter:
    """Write RGB frames as a video file (.mp4, H.264 where the FFmpeg build has it, else MPEG-4), at `fps`.

    Frames of odd width or height lose their last column / row (4:2:0 chroma needs even sizes).
    Use: `with VideoWriter(path, fps) as w: w.write(frame)` with [H, W, 3] uint8 frames of one size.
    """

    def __init__(self, path: str, fps: float, codec: str | None = None):
        self.path, self.fps, self.codec = path, fps, codec
        self._container = self._stream = None

    def __enter__(self):
        return self

    def _open(self, height: int, width: int) -> None:
        av = require_av()
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._container = av.open(self.path, mode="w")
        rate = Fraction(self.fps).limit_denominator(1001)
        for name in ([self.codec] if self.codec else OUTPUT_CODECS):
            if name in av.codecs_available:
                self._stream = self._container.add_stream(name, rate=rate)
                break
        self._stream.width, self._stream.height = width - width % 2, height - height % 2
        self._stream.pix_fmt = "yuv420p"

    def write(self, frame: np.ndarray) -> None:
        av = require_av()
        if self._container is None:
            self._open(*frame.shape[:2])
        frame = np.ascontiguousarray(frame[: self._stream.height, : self._stream.width])
        for packet in self._stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            self._container.mux(packet)

    def close(self) -> None:
        if self._container is not None:
            for packet in self._stream.encode():
                self._container.mux(packet)
            self._container.close()
            self._container = None

    def __exit__(self, *exc):
        self.close()
