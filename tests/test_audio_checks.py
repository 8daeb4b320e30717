"""The narrowband and trained-delay checks (models/audio_checks.py) against audio whose band is known by
construction: the bundled wideband sample, the same speech through soxr down to 8 kHz and back, and through
the synthetic phone line the tiny-v2 corpora use; and the engine's front end saying so once. Also
`load_audio`'s length limit, which keeps a long file from being decoded whole."""
import asyncio
import io
import logging

import numpy as np
import pytest
import soundfile
import soxr

from jaxstream.engine.audio_front_end import FrontEndWorker
from jaxstream.models import audio_checks, checkpoint_metadata, loading
from jaxstream.models.audio import AudioTooLongError, StreamingLogMel, load_audio, resample_to_16k
from jaxstream.models.config import VoxtralConfig
from jaxstream.synth.augment import band_limit, telephone

SAMPLE = loading.BUILTIN_MODELS["tiny"].parent / "samples" / "sample.wav"


@pytest.fixture(scope="module")
def wideband():
    return load_audio(SAMPLE)


def test_wideband_speech_is_not_narrowband(wideband):
    # The bundled sample (espeak-ng, a clean synthetic voice) has ~95x the threshold's share above 4.2 kHz.
    assert audio_checks.high_band_energy_share(wideband) > 30 * audio_checks.NARROWBAND_ENERGY_SHARE
    assert audio_checks.narrowband_reason(wideband) is None
    assert audio_checks.narrowband_reason(wideband, source_rate=44100) is None


def test_upsampled_8khz_audio_is_narrowband(wideband):
    upsampled = soxr.resample(soxr.resample(wideband, 16000, 8000), 8000, 16000)
    assert "no energy above 4.2 kHz" in audio_checks.narrowband_reason(upsampled)
    phone_line = telephone(wideband, np.random.default_rng(0))
    assert audio_checks.narrowband_reason(phone_line) is not None
    # The declared rate alone decides for an 8 kHz source, whatever the resampled samples look like.
    assert audio_checks.narrowband_reason(wideband, source_rate=8000) == "the audio is sampled at 8000 Hz"


def test_band_limited_16khz_speech_is_not_called_upsampled_from_8khz(wideband, tmp_path):
    """3 of the 300 utterances of the wideband held-out set (`jaxstream synth --held-out --text sentences --seed
    1`) were "upsampled from 8 kHz?": 16 kHz speech through the sentence corpora's microphone band
    (`band_limit`) with its upper edge at 3.5-3.65 kHz, nothing above ~4.7 kHz (shares 2.4e-6 .. 6.5e-6). An
    upsampled phone line stored as 16-bit PCM has a share as high when it is quiet, so the share cannot tell the
    two apart: the reason says what was measured and names both causes."""
    microphone = band_limit(wideband, low_hz=132, high_hz=3645)  # 9007-2-00117's band, on the bundled sample
    reason = audio_checks.narrowband_reason(microphone)
    assert reason is not None and "upsampled" not in reason and "band-limited microphone" in reason, reason
    quiet_line = soxr.resample(soxr.resample(wideband, 16000, 8000), 8000, 16000)
    quiet_line *= 0.02 / np.abs(quiet_line).max()
    path = tmp_path / "line.wav"
    soundfile.write(path, quiet_line, 16000, subtype="PCM_16")
    stored = load_audio(path)
    for audio in (microphone, stored):  # the same decade: no threshold between them
        assert 1e-6 < audio_checks.high_band_energy_share(audio) < audio_checks.NARROWBAND_ENERGY_SHARE
    assert audio_checks.file_narrowband_reason(path, stored) == reason
    assert "8 kHz source such as a phone line" in reason


def test_the_cli_can_mute_the_engines_narrowband_warnings(caplog):
    """The CLI names each narrowband file itself; the engine's warning, which can name none, is muted then."""
    warn = audio_checks.WarnOnce(audio_checks.narrowband_logger)
    with caplog.at_level(logging.WARNING):
        with audio_checks.engine_narrowband_warnings_muted():
            warn("muted")
        warn("heard")
    assert [record.getMessage() for record in caplog.records] == ["heard"]


def test_no_judgement_on_silence_or_too_little_audio(wideband):
    assert audio_checks.high_band_energy_share(np.zeros(16000, np.float32)) is None
    assert audio_checks.high_band_energy_share(wideband[:100]) is None
    assert audio_checks.narrowband_reason(np.zeros(16000, np.float32)) is None


def test_delay_outside_the_trained_range():
    tiny = checkpoint_metadata.inspect_checkpoint(loading.BUILTIN_MODELS["tiny"]).config
    assert tiny.trained_delays_ms == (160, 960)  # configs/tiny.toml's delays_ms, recorded in the checkpoint
    assert audio_checks.delay_warning(tiny, 480) is None
    assert audio_checks.delay_warning(tiny, 960) is None
    assert "outside the delays this model was trained at (160-960 ms)" in audio_checks.delay_warning(tiny, 2400)
    assert audio_checks.delay_warning(tiny, 80) is not None
    unknown = VoxtralConfig(encoder=tiny.encoder, text=tiny.text)  # a hub checkpoint records no range
    assert audio_checks.delay_warning(unknown, 2400) is None


def test_warn_once_logs_each_distinct_message_once(caplog):
    warn = audio_checks.WarnOnce(logging.getLogger("jaxstream.test_audio_checks"))
    with caplog.at_level(logging.WARNING):
        for message in ("a", None, "b", "a", "b"):
            warn(message)
    assert [record.getMessage() for record in caplog.records] == ["a", "b"]


async def _stream_through(worker, pcm, sample_rate=16000, piece=1280):
    stream = worker.stream(StreamingLogMel(n_delay=6), sample_rate)
    for start in range(0, pcm.size, piece):
        await stream.push(pcm[start:start + piece])
    await stream.finish()


async def test_the_front_end_judges_each_stream_once(wideband):
    warnings = []
    worker = FrontEndWorker(warn=warnings.append)
    try:
        await _stream_through(worker, wideband)
        assert warnings == []
        upsampled = soxr.resample(soxr.resample(wideband, 16000, 8000), 8000, 16000)
        await _stream_through(worker, upsampled)  # judged after PROBE_SECONDS, not again at the end
        assert warnings == [audio_checks.narrowband_warning(audio_checks.narrowband_reason(upsampled))]
        short = upsampled[:16000]  # shorter than the probe: judged at the end of the stream
        await _stream_through(worker, short)
        assert len(warnings) == 2
        await _stream_through(worker, soxr.resample(wideband, 16000, 8000), sample_rate=8000)
        assert warnings[-1] == audio_checks.narrowband_warning("the audio is sampled at 8000 Hz")
    finally:
        worker.close()


async def test_a_stream_is_judged_while_it_is_still_streaming(wideband):
    """The verdict comes from the stream's first PROBE_SECONDS, judged while the worker has nothing else to
    do, not only at the stream's end."""
    warnings = []
    worker = FrontEndWorker(warn=warnings.append)
    try:
        upsampled = soxr.resample(soxr.resample(wideband, 16000, 8000), 8000, 16000)
        assert upsampled.size > audio_checks.PROBE_SECONDS * 16000
        stream = worker.stream(StreamingLogMel(n_delay=6))
        for start in range(0, upsampled.size, 1280):
            await stream.push(upsampled[start:start + 1280])
        for _ in range(500):
            if warnings:
                break
            await asyncio.sleep(0.01)
        assert warnings == [audio_checks.narrowband_warning(audio_checks.narrowband_reason(upsampled))]
        await stream.finish()
        assert len(warnings) == 1
    finally:
        worker.close()



# -- load_audio's length limit ----------------------------------------------------------------------------------
def flac(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="FLAC")
    return buffer.getvalue()


@pytest.mark.parametrize("declares_length", [True, False])
def test_load_audio_refuses_a_long_file_without_decoding_it_whole(monkeypatch, soundfile_reads, declares_length):
    """A compressed file of hours of silence is small, its samples gigabytes (a 2.7 MB FLAC of 2 h of 96 kHz
    stereo decoded to 12 GB before the server checked its length). With `max_seconds` a file is refused from
    the length it declares, or, when it declares none (libsndfile's unknown-length count), once the decoding,
    a block at a time, passes the limit; audio within the limit decodes as before."""
    rate = 8000
    long_silence = flac(np.zeros((60 * rate, 2), np.float32), rate)
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, (3 * rate, 2)).astype(np.float32)
    short_noise = flac(noise, rate)
    expected = resample_to_16k(soundfile.read(io.BytesIO(short_noise), dtype="float32")[0].mean(axis=1), rate)
    requested = soundfile_reads
    requested.clear()  # the reads of load_audio below, not of `expected` above
    if not declares_length:
        monkeypatch.setattr(soundfile.SoundFile, "frames", property(lambda self: 2**63 - 1))
    with pytest.raises(AudioTooLongError) as raised:
        load_audio(long_silence, max_seconds=10)
    assert raised.value.seconds == (60 if declares_length else None)
    if declares_length:
        assert requested == []
    else:
        assert requested and all(0 < frames < 60 * rate for frames in requested)
        assert sum(requested) < 60 * rate
    np.testing.assert_array_equal(load_audio(short_noise, max_seconds=3), expected)
