"""Audio clips in memory: one second at 8 kHz of tones, chirps, beeps or noise bursts over background noise,
and the transforms that crop, shift and turn them into log-mel spectrograms (``torch.stft``, no torchaudio).

Samples are ``(int16 tensor (1, samples), int label)``, as a WAV file decodes. The transforms are
``nn.Module`` pipelines that draw their crop and shift from torch's global generator only.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

SAMPLE_RATE = 8000
CLASSES = ("tone", "chirp-up", "chirp-down", "beeps", "noise-burst")


class Clips:
    """A map-style dataset of mono int16 clips held in memory.

    Args:
        waves: int16 of shape (N, samples).
        labels: Class indices, shape (N,).
        sample_rate: Samples per second.
    """

    def __init__(self, waves: np.ndarray, labels: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
        if waves.dtype != np.int16 or waves.ndim != 2:
            raise ValueError(f"waves: dtype={waves.dtype} shape={waves.shape}; expected int16 (N, samples)")
        if labels.shape != (len(waves),):
            raise ValueError(f"labels: shape={labels.shape}; expected ({len(waves)},), one label per clip")
        self.waves, self.labels = waves, labels.astype(np.int64)
        self.sample_rate, self.classes = sample_rate, list(CLASSES)

    def __len__(self) -> int:
        return len(self.waves)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.waves[index : index + 1]), int(self.labels[index])


def make(n: int = 1000, seed: int = 0, seconds: float = 1.0, sample_rate: int = SAMPLE_RATE,
         snr_db: tuple[float, float] = (0.0, 20.0)) -> Clips:
    """``n`` clips, classes in turn (``i % 5``), each drawn from ``seed`` (1,000 take about 0.3 s).

    Each clip holds one event of 0.45 to 0.6 s at a random onset, pitch and loudness, faded in and
    out over 10 ms, in white background noise at a random signal-to-noise ratio from ``snr_db``.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"make(n={n!r}): n must be a positive integer")
    rng = np.random.default_rng(seed)
    length = int(round(seconds * sample_rate))
    labels = np.arange(n) % len(CLASSES)
    waves = np.zeros((n, length), dtype=np.float32)
    for i, label in enumerate(labels):
        dur = int(rng.uniform(0.45, 0.6) * sample_rate)
        onset = int(rng.integers(0, max(length - dur, 0) + 1))
        amp = rng.uniform(0.2, 0.6)
        event = _event(int(label), rng, np.arange(dur, dtype=np.float32) / sample_rate, sample_rate)
        waves[i, onset : onset + dur] = amp * event[: length - onset] * _fade(dur, sample_rate)[: length - onset]
        noise_std = amp / math.sqrt(2) / 10 ** (rng.uniform(*snr_db) / 20)
        waves[i] += rng.normal(0, noise_std, size=length).astype(np.float32)
    return Clips(np.clip(np.rint(waves * 32767), -32768, 32767).astype(np.int16), labels, sample_rate)


def _event(label: int, rng: np.random.Generator, t: np.ndarray, sample_rate: int) -> np.ndarray:
    """One event of class ``label`` at times ``t`` (seconds), peak amplitude about 1."""
    f0 = rng.uniform(300, 1200)
    if label == 0:
        return np.sin(2 * np.pi * f0 * t + rng.uniform(0, 2 * np.pi))
    if label in (1, 2):
        f1 = f0 * rng.uniform(2.0, 3.0)
        start, end = (f0, f1) if label == 1 else (f1, f0)
        return np.sin(2 * np.pi * (start * t + (end - start) * t**2 / (2 * t[-1])))  # a linear sweep
    if label == 3:
        gate = np.sin(2 * np.pi * rng.uniform(6, 12) * t) > 0
        return np.sin(2 * np.pi * f0 * t) * gate
    return np.clip(rng.normal(0, 0.4, size=t.shape), -1, 1)


def _fade(length: int, sample_rate: int) -> np.ndarray:
    """An envelope that rises over the first 10 ms and falls over the last (no clicks)."""
    ramp = min(int(0.01 * sample_rate), length // 2)
    envelope = np.ones(length, dtype=np.float32)
    envelope[:ramp] = np.linspace(0, 1, ramp, dtype=np.float32)
    envelope[length - ramp :] = np.linspace(1, 0, ramp, dtype=np.float32)
    return envelope


class ToFloat(nn.Module):
    """int16 PCM -> float32 in [-1, 1)."""

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return wave.float() / 32768.0


class RandomCrop1d(nn.Module):
    """A random window of ``length`` samples (the start from torch's global generator)."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        if wave.shape[-1] < self.length:
            raise ValueError(f"RandomCrop1d(length={self.length}): the clip has only {wave.shape[-1]} samples")
        start = int(torch.randint(0, wave.shape[-1] - self.length + 1, ()))
        return wave[..., start : start + self.length]


class CenterCrop1d(nn.Module):
    """The middle ``length`` samples."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        if wave.shape[-1] < self.length:
            raise ValueError(f"CenterCrop1d(length={self.length}): the clip has only {wave.shape[-1]} samples")
        start = (wave.shape[-1] - self.length) // 2
        return wave[..., start : start + self.length]


class RandomRoll(nn.Module):
    """A circular time shift of up to ``max_shift`` samples either way (torch's global generator)."""

    def __init__(self, max_shift: int) -> None:
        super().__init__()
        self.max_shift = max_shift

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return torch.roll(wave, int(torch.randint(-self.max_shift, self.max_shift + 1, ())), dims=-1)


def mel_filterbank(n_freqs: int, n_mels: int, sample_rate: int, f_min: float = 0.0,
                   f_max: float | None = None) -> torch.Tensor:
    """Triangular filters (n_freqs, n_mels) on the HTK mel scale, each peaking at 1 at its centre
    (torchaudio's ``melscale_fbanks`` with ``norm=None, mel_scale="htk"``)."""
    f_max = sample_rate / 2 if f_max is None else f_max
    mel = torch.linspace(_hz_to_mel(f_min), _hz_to_mel(f_max), n_mels + 2, dtype=torch.float64)
    edges = 700.0 * (10.0 ** (mel / 2595.0) - 1.0)  # Hz: each filter's lower edge, centre and upper edge
    freqs = torch.linspace(0, sample_rate / 2, n_freqs, dtype=torch.float64)[:, None]
    rising = (freqs - edges[:-2]) / (edges[1:-1] - edges[:-2])
    falling = (edges[2:] - freqs) / (edges[2:] - edges[1:-1])
    return torch.clamp(torch.minimum(rising, falling), min=0.0).float()


def _hz_to_mel(hz: float) -> float:
    return 2595.0 * math.log10(1.0 + hz / 700.0)


class LogMel(nn.Module):
    """(channels, samples) float -> (channels, n_mels, frames) log-mel power spectrogram.

    Args:
        sample_rate: Samples per second.
        n_fft: FFT size (a Hann window of that length).
        hop: Samples between frames; frames = samples // hop + 1 (centred).
        n_mels: Mel bands.
        f_min: Lowest band edge, Hz.
    """

    def __init__(self, sample_rate: int = SAMPLE_RATE, n_fft: int = 256, hop: int = 64, n_mels: int = 40,
                 f_min: float = 50.0) -> None:
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.register_buffer("filters", mel_filterbank(n_fft // 2 + 1, n_mels, sample_rate, f_min), persistent=False)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(wave, self.n_fft, self.hop, window=self.window, center=True, return_complex=True)
        power = spec.real**2 + spec.imag**2  # (channels, freqs, frames)
        return torch.log(torch.einsum("cft,fm->cmt", power, self.filters) + 1e-6)


def train_transform(window_s: float = 0.75, max_shift_s: float = 0.1, sample_rate: int = SAMPLE_RATE,
                    n_fft: int = 256, hop: int = 64, n_mels: int = 40) -> nn.Sequential:
    """Training: int16 clip -> random ``window_s`` crop -> random roll of up to ``max_shift_s`` -> log-mel."""
    return nn.Sequential(ToFloat(), RandomCrop1d(int(window_s * sample_rate)),
                         RandomRoll(int(max_shift_s * sample_rate)), LogMel(sample_rate, n_fft, hop, n_mels))


def eval_transform(window_s: float = 0.75, sample_rate: int = SAMPLE_RATE, n_fft: int = 256, hop: int = 64,
                   n_mels: int = 40) -> nn.Sequential:
    """Evaluation: int16 clip -> the middle ``window_s`` -> log-mel; nothing random."""
    return nn.Sequential(ToFloat(), CenterCrop1d(int(window_s * sample_rate)), LogMel(sample_rate, n_fft, hop, n_mels))
