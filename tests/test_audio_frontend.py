"""The Voxtral audio front end against transformers' feature extractor and mistral-common's padding.

Oracles: tests/fixtures/voxtral_tiny_reference.npz (transformers float32 features, made by
tests/make_reference_fixtures.py), tests/fixtures/frontend_reference.npz (the same transformers algorithm
in float64 too, made by tests/make_frontend_fixture.py), mistral-common's AudioEncoder on the fixture
tekken.json, and the offline features for the streaming front end.
"""
import io
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile
import soxr

from jaxstream.models import audio

FIXTURES = Path(__file__).parent / "fixtures"
# transformers runs the STFT in float32; its round-off reaches ~2.5e-5 in low-power bins of tonal audio
# (frontend_reference.npz measures it against the float64 run, which jaxstream matches to float32 rounding).
FLOAT32_REFERENCE_MAX_ERROR = 3e-5
FLOAT32_REFERENCE_TYPICAL_ERROR = 1e-5  # bound on the 99.9th percentile


@pytest.fixture(scope="module")
def model_reference():
    return np.load(FIXTURES / "voxtral_tiny_reference.npz")


@pytest.fixture(scope="module")
def frontend_reference():
    return np.load(FIXTURES / "frontend_reference.npz")


@pytest.fixture(scope="module")
def audio_encoder():
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tokenizer = MistralTokenizer.from_file(str(FIXTURES / "voxtral_tiny" / "tekken.json"))
    return tokenizer.instruct_tokenizer.audio_encoder


def assert_close_to_float32_reference(features: np.ndarray, reference_hf_layout: np.ndarray) -> None:
    error = np.abs(features - reference_hf_layout.T)
    assert features.shape == reference_hf_layout.T.shape
    assert error.max() <= FLOAT32_REFERENCE_MAX_ERROR, error.max()
    assert np.quantile(error, 0.999) <= FLOAT32_REFERENCE_TYPICAL_ERROR


def test_mel_filters_equal_transformers(model_reference):
    assert audio.MEL_FILTERS.shape == (201, 128)
    np.testing.assert_array_equal(audio.MEL_FILTERS.astype(np.float32), model_reference["mel_filters"])


@pytest.mark.parametrize("length", [16000, 12345])
def test_log_mel_matches_transformers(model_reference, length):
    features = audio.log_mel(model_reference[f"fe_input_{length}"])
    assert features.dtype == np.float32 and features.shape == (length // 160, 128)
    assert_close_to_float32_reference(features, model_reference[f"fe_output_{length}_center"])


def test_log_mel_matches_float64_reference_including_reflect_padding(frontend_reference):
    features = audio.log_mel(frontend_reference["short_audio"])
    np.testing.assert_allclose(features, frontend_reference["short_float64"].T, rtol=0, atol=1e-6)
    assert_close_to_float32_reference(features, frontend_reference["short_float32"])


@pytest.mark.parametrize("n_delay", [6, 2])
def test_offline_features_match_transformers(model_reference, n_delay):
    raw = model_reference["audio"]
    np.testing.assert_array_equal(audio.pad_for_offline(raw, n_delay), model_reference[f"padded_audio_d{n_delay}"])
    features = audio.offline_features(raw, n_delay)
    assert_close_to_float32_reference(features, model_reference[f"features_d{n_delay}"][0])


def test_offline_features_match_float64_reference(frontend_reference):
    n_delay = int(frontend_reference["n_delay"])
    raw = frontend_reference["audio"]
    np.testing.assert_array_equal(audio.pad_for_offline(raw, n_delay), frontend_reference["padded_audio"])
    features = audio.offline_features(raw, n_delay)
    np.testing.assert_allclose(features, frontend_reference["features_float64"].T, rtol=0, atol=1e-6)
    assert_close_to_float32_reference(features, frontend_reference["features_float32"])


@pytest.mark.parametrize("delay_ms", [80, 480, 1200, 2400])
@pytest.mark.parametrize("num_samples", [0, 1, 1279, 1280, 5000])
def test_padding_and_prompt_match_mistral_common(audio_encoder, delay_ms, num_samples):
    n_delay = audio.n_delay_from_ms(delay_ms)
    raw = np.random.default_rng(num_samples).uniform(-1, 1, num_samples).astype(np.float32)
    expected = audio_encoder.pad(raw, 16000, transcription_delay_ms=delay_ms)
    np.testing.assert_array_equal(audio.pad_for_offline(raw, n_delay), expected)
    assert audio.left_pad_samples() + num_samples + audio.right_pad_samples(num_samples, n_delay) == expected.size
    assert audio.prompt_length(n_delay) == 1 + len(audio_encoder.encode_streaming_tokens(delay_ms))


def test_delay_values(audio_encoder):
    for delay_ms in audio.ALLOWED_DELAYS_MS:
        assert audio.n_delay_from_ms(delay_ms) == audio_encoder.audio_config.get_num_delay_tokens(delay_ms)
    assert audio.n_delay_from_ms(480) == 6 and audio.n_delay_from_ms(480.0) == 6
    assert audio.prompt_length(6) == 39
    assert math.isclose(audio.LOOK_AHEAD_SAMPLES / 16, audio_encoder.audio_config.streaming_look_ahead_ms)
    for bad in (0, 40, 81, 500, 1280, 2320, 2480, -80, 480.5, "480", None, True):
        with pytest.raises(ValueError, match="multiple of 80 between 80 and 1200, or 2400|milliseconds"):
            audio.n_delay_from_ms(bad)


def stream_in_pieces(raw: np.ndarray, n_delay: int, piece_sizes, take_every_push: bool) -> np.ndarray:
    """Feed `raw` in the given piece sizes (cycled) and collect every slot; checks the readiness counters."""
    stream = audio.StreamingLogMel(n_delay)
    slots, position, sizes = [], 0, itertools.cycle(piece_sizes)
    while position < raw.size:
        piece = raw[position : position + next(sizes)]
        needed = stream.samples_until_next_slot
        ready = stream.push(piece)
        position += piece.size
        padded_end = audio.left_pad_samples() + position
        computable = (padded_end - 40) // 1280
        expected_ready = computable - stream.slots_taken if computable >= stream.prompt_slots else 0
        assert ready == stream.slots_ready == expected_ready
        assert stream.slots_at(stream.samples_received) == stream.slots_taken + ready  # predicted alike
        assert (ready > 0) == (piece.size >= needed)
        if take_every_push:
            slots.append(stream.take())
            assert stream.slots_ready == 0
            if stream.slots_taken:  # only the history and the next slot's partial samples are kept
                assert stream.retained_samples < 200 + 1280 + 40
    assert stream.samples_received == raw.size and not stream.finished
    stream.finish()
    assert stream.total_slots == audio.pad_for_offline(raw, n_delay).size // 1280
    while not stream.done:
        slots.append(stream.take(max_slots=5))
    return np.concatenate(slots).reshape(-1, 128)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_equals_offline_for_random_pieces(seed):
    rng = np.random.default_rng(seed)
    n_delay = int(rng.choice([1, 6, 15]))
    raw = (0.1 * rng.standard_normal(int(rng.integers(20000, 40000)))).astype(np.float32)
    # Ragged pieces (empty ones too), with 3000 single samples across the prompt's completion.
    prompt_audio = (n_delay + 1) * 1280 + 40
    cuts = np.sort(rng.integers(0, prompt_audio - 1500, 6))
    sizes = list(np.diff(cuts, prepend=0, append=prompt_audio - 1500)) + [1] * 3000 + list(rng.integers(1, 3000, 100))
    streamed = stream_in_pieces(raw, n_delay, sizes + [4096], take_every_push=bool(seed % 2))
    np.testing.assert_allclose(streamed, audio.offline_features(raw, n_delay), rtol=0, atol=1e-6)


def test_prompt_slots_arrive_together_then_one_slot_per_1280_samples():
    stream = audio.StreamingLogMel(n_delay=6)
    assert stream.prompt_slots == 39 and stream.samples_until_next_slot == 9000
    # Of the 40,960 samples of left padding only those the first computed slot reads are kept.
    assert stream.retained_samples == audio.SAMPLES_PER_SLOT + 200
    assert stream.push(np.zeros(8999, np.float32)) == 0 and stream.samples_until_next_slot == 1
    assert stream.push(np.zeros(1, np.float32)) == 39
    assert stream.take(10).shape == (10, 8, 128) and stream.slots_ready == 29
    stream.take()
    assert stream.push(np.zeros(1279, np.float32)) == 0 and stream.samples_until_next_slot == 1
    assert stream.push(np.zeros(1, np.float32)) == 1
    assert stream.take(0).shape == (0, 8, 128)


def test_finish_before_the_prompt_is_complete():
    raw = np.random.default_rng(5).uniform(-0.5, 0.5, 700).astype(np.float32)
    streamed = stream_in_pieces(raw, 6, [300], take_every_push=True)
    np.testing.assert_allclose(streamed, audio.offline_features(raw, 6), rtol=0, atol=1e-6)


def test_long_stream_keeps_bounded_memory():
    rng = np.random.default_rng(7)
    seconds = 35
    t = np.arange(seconds * 16000) / 16000
    raw = (0.3 * np.sin(2 * np.pi * 300 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    streamed = stream_in_pieces(raw, 6, rng.integers(1000, 6000, 1000), take_every_push=True)
    offline = audio.offline_features(raw, 6)
    assert streamed.shape == offline.shape and offline.shape[0] > seconds * 100
    np.testing.assert_allclose(streamed, offline, rtol=0, atol=1e-6)


def test_take_ready_of_streams_at_different_points_equals_each_offline():
    # One batch holding a stream's prompt (31 silent slots skipped, 8 computed), a steady slot, and a whole
    # finished stream of more slots than one computed block (64): each equals its own offline features.
    rng = np.random.default_rng(11)
    raws = [(0.2 * rng.standard_normal(n)).astype(np.float32) for n in (9000, 30000, 120000)]
    streams = [audio.StreamingLogMel(6) for _ in raws]
    taken = [[] for _ in raws]
    streams[1].push(raws[1][:20000])
    taken[1].append(streams[1].take())
    streams[0].push(raws[0])
    streams[1].push(raws[1][20000:])
    streams[2].push(raws[2])
    streams[2].finish()
    assert streams[2].slots_ready > 64
    for stream, slots in zip(streams, audio.take_ready([(stream, stream.slots_ready) for stream in streams])):
        taken[streams.index(stream)].append(slots)
    for stream in streams[:2]:
        stream.finish()
    for stream, slots in zip(streams, audio.take_ready([(stream, stream.slots_ready) for stream in streams])):
        taken[streams.index(stream)].append(slots)
    for raw, slots in zip(raws, taken):
        np.testing.assert_allclose(np.concatenate(slots).reshape(-1, 128), audio.offline_features(raw, 6),
                                   rtol=0, atol=1e-6)


def test_slots_of_padding_alone_are_not_computed(monkeypatch):
    """Slots whose windows read only left or right padding are copies of SILENT_SLOT, not computed: taken a
    few at a time across both edges, the features still equal the offline ones, and the rows computed are
    exactly those of the slots that read any audio (counted on the padded signal itself)."""
    raw = (0.2 * np.random.default_rng(5).standard_normal(20011)).astype(np.float32)
    padded = audio.pad_for_offline(raw, 6)
    offline = audio.offline_features(raw, 6)
    # Slot k reads padded samples [1280 k - 200, 1280 k + 1320); past either end there are only zeros.
    first_audio, last_audio = np.flatnonzero(padded)[[0, -1]]
    reads_audio = [k for k in range(padded.size // audio.SAMPLES_PER_SLOT)
                   if 1280 * k - 200 <= last_audio and 1280 * k + 1320 > first_audio]
    computed_rows = []
    original = audio._frames_to_log_mel
    monkeypatch.setattr(audio, "_frames_to_log_mel",
                        lambda frames, *args, **kwargs: computed_rows.append(len(frames)) or original(frames, *args,
                                                                                                      **kwargs))
    stream = audio.StreamingLogMel(6)
    taken = []
    for piece in np.array_split(raw, 7):
        stream.push(piece)
        taken.append(stream.take(3))
    stream.finish()
    while not stream.done:
        taken.append(stream.take(3))
    features = np.concatenate(taken).reshape(-1, 128)
    np.testing.assert_allclose(features, offline, rtol=0, atol=1e-6)
    assert sum(computed_rows) == audio.MEL_FRAMES_PER_SLOT * len(reads_audio)
    assert len(features) > audio.MEL_FRAMES_PER_SLOT * (reads_audio[-1] + 10)  # a long silent tail was skipped


def test_sample_magnitude_bound():
    stream = audio.StreamingLogMel(6)
    bound = audio.MAX_SAMPLE_MAGNITUDE
    stream.push(np.array([bound, -bound, 0.0], np.float32))
    for bad in ([0.0, np.nextafter(bound, 3.0)], [-2.5 * bound], [np.nan, 0.0], [0.0, -np.inf]):
        with pytest.raises(ValueError, match="magnitude|NaN or infinite"):
            stream.push(np.array(bad, np.float64))
    assert stream.samples_received == 3


def test_input_validation():
    good = np.zeros(16000, np.float32)
    with pytest.raises(ValueError, match="16000 Hz"):
        audio.log_mel(good, sampling_rate=8000)
    with pytest.raises(ValueError, match="16000 Hz"):
        audio.offline_features(good, 6, sampling_rate=44100)
    with pytest.raises(ValueError, match="16000 Hz"):
        audio.StreamingLogMel(6, sampling_rate=24000)
    with pytest.raises(ValueError, match="1-D"):
        audio.log_mel(np.zeros((2, 16000), np.float32))
    with pytest.raises(ValueError, match="NaN or infinite"):
        audio.log_mel(np.full(1000, np.nan, np.float32))
    with pytest.raises(ValueError, match="float PCM"):
        audio.log_mel(np.zeros(1000, np.int16))
    with pytest.raises(ValueError, match="longer than 200"):
        audio.log_mel(np.zeros(200, np.float32))
    stream = audio.StreamingLogMel(6)
    with pytest.raises(ValueError, match="1-D"):
        stream.push(np.zeros((10, 2), np.float32))
    with pytest.raises(ValueError, match="NaN or infinite"):
        stream.push(np.array([0.0, np.inf], np.float32))
    assert stream.samples_received == 0
    stream.finish()
    with pytest.raises(ValueError, match="after finish"):
        stream.push(good)


def test_pcm16_to_float32():
    values = np.array([0, 1, -1, 32767, -32768, 12345, -4321], dtype=np.int64)
    data = b"".join(int(v).to_bytes(2, "little", signed=True) for v in values)
    converted = audio.pcm16_to_float32(data)
    assert converted.dtype == np.float32
    np.testing.assert_array_equal(converted, (values / 32768.0).astype(np.float32))
    with pytest.raises(ValueError, match="even number of bytes"):
        audio.pcm16_to_float32(data[:-1])


def sine(frequency: float, rate: int, seconds: float) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * frequency * np.arange(int(rate * seconds)) / rate)).astype(np.float32)


@pytest.mark.parametrize("rate", [8000, 24000, 44100])
def test_resample_to_16k_against_analytic_sine(rate):
    resampled = audio.resample_to_16k(sine(440, rate, 0.5), rate)
    assert resampled.dtype == np.float32 and abs(resampled.size - 8000) <= 1
    expected = sine(440, 16000, 0.5)[: resampled.size]
    middle = slice(400, resampled.size - 400)  # away from the filter's edge transients
    np.testing.assert_allclose(resampled[middle], expected[middle], atol=2e-3)


def test_loud_audio_resampled_offline_stays_within_what_its_input_was_checked_against():
    """A square wave at the largest magnitude the checks take rings to 1.36 x that through soxr: resample_to_16k
    and load_audio (of a float file) clip it as the streaming front end does, so the offline path takes the audio
    a stream takes (its 16 kHz features refused it). Inside the limit, clipping touches nothing but the ringing:
    the samples equal soxr's wherever soxr's are within it."""
    limit = audio.MAX_SAMPLE_MAGNITUDE
    loud = (limit * np.sign(np.sin(2 * np.pi * 700 * np.arange(8000) / 8000))).astype(np.float32)
    exact = soxr.resample(loud, 8000, 16000, quality="HQ")
    assert np.abs(exact).max() > 1.3 * limit  # the ringing this is about
    buffer = io.BytesIO()
    soundfile.write(buffer, loud, 8000, format="WAV", subtype="FLOAT")
    for resampled in (audio.resample_to_16k(loud, 8000), audio.load_audio(buffer.getvalue())):
        audio.check_pcm(resampled)
        inside = np.abs(exact) <= limit
        np.testing.assert_allclose(resampled[inside], exact[inside], atol=2**-20)
        assert np.array_equal(resampled[~inside], np.sign(exact[~inside]) * limit)


def test_resample_to_16k_validation():
    np.testing.assert_array_equal(audio.resample_to_16k(np.ones(5, np.float64), 16000), np.ones(5, np.float32))
    for bad_rate in (0, -16000, 16000.5, None):
        with pytest.raises(ValueError, match="sampling rate"):
            audio.resample_to_16k(np.ones(5, np.float32), bad_rate)


def chirp(start_hz: float, end_hz: float, rate: int, seconds: float) -> np.ndarray:
    """A linear sweep: unlike a sum of sines it has no period, so its alignment is unambiguous."""
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * (start_hz * t + (end_hz - start_hz) / (2 * seconds) * t**2))).astype(np.float32)


@pytest.mark.parametrize("file_format, subtype, max_lag, tolerance", [
    ("WAV", "PCM_16", 0, 1e-3), ("FLAC", "PCM_16", 0, 1e-3),
    ("OGG", "VORBIS", 1200, 0.02), ("MP3", "MPEG_LAYER_III", 1200, 0.02),
])
def test_load_audio_downmixes_and_resamples(tmp_path, file_format, subtype, max_lag, tolerance):
    rate, seconds = 22050, 1.0
    stereo = np.stack([chirp(200, 3000, rate, seconds), chirp(2500, 300, rate, seconds)], axis=1)
    path = tmp_path / f"clip.{file_format.lower()}"
    soundfile.write(path, stereo, rate, format=file_format, subtype=subtype)
    loaded = audio.load_audio(path)
    assert loaded.dtype == np.float32 and loaded.ndim == 1
    expected = (chirp(200, 3000, 16000, seconds) + chirp(2500, 300, 16000, seconds)) / 2
    assert abs(loaded.size - expected.size) <= 1600  # lossy codecs pad the stream a little
    # Lossy codecs also delay it, so compare the middle of the clip at the best lag.
    middle = expected[2000:14000]
    errors = {lag: np.abs(loaded[2000 + lag : 14000 + lag] - middle).mean() for lag in range(-max_lag, max_lag + 1)
              if 2000 + lag >= 0 and 14000 + lag <= loaded.size}
    assert min(errors.values()) < tolerance
    np.testing.assert_array_equal(audio.load_audio(path.read_bytes()), loaded)


def test_load_audio_errors(tmp_path):
    missing = tmp_path / "nope.wav"
    with pytest.raises(ValueError, match=f"audio file not found: {missing}"):
        audio.load_audio(missing)
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"this is not audio" * 10)
    with pytest.raises(ValueError, match="cannot decode audio .*garbage.wav"):
        audio.load_audio(garbage)
    with pytest.raises(ValueError, match="cannot decode audio <audio bytes>"):
        audio.load_audio(b"\x00\x01" * 50)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(100, np.float32), 16000, format="WAV")
    assert audio.load_audio(buffer.getvalue()).size == 100


# -- load_audio resamples as it decodes ---------------------------------------------------------------------------
# soxr's "HQ" quality promises 20-bit precision: two resamplings of the same signal that differ by less than one
# part in 2**20 of full scale differ by less than the error soxr allows either of them. (Measured: 0, the
# streaming and whole-signal paths run the same filter on the same samples.)
HQ_PRECISION = 2.0**-20


def _flac(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="FLAC", subtype="PCM_24")
    return buffer.getvalue()


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000, 96000])
@pytest.mark.parametrize("declares_length", [True, False])
def test_load_audio_block_by_block_equals_the_whole_signal_resampled(rate, declares_length, monkeypatch):
    """load_audio resamples each decoded block as it comes (soxr's ResampleStream); the samples must be those of
    the whole downmixed signal resampled at once (soxr.resample, what it did before), across block boundaries
    and with the filter's tail flushed (same length). A file of unknown length (libsndfile's count for one,
    and a first buffer of 0.1 s, so that the output buffer must grow) loads the same."""
    import soxr

    frames = int(3.5 * audio._DECODE_BLOCK_FRAMES)
    stereo = np.random.default_rng(rate).uniform(-0.7, 0.7, (frames, 2)).astype(np.float32)
    data = _flac(stereo, rate)
    whole = soxr.resample(soundfile.read(io.BytesIO(data), dtype="float32")[0].mean(axis=1), rate,
                          audio.SAMPLING_RATE, quality="HQ")
    if not declares_length:
        monkeypatch.setattr(soundfile.SoundFile, "frames", property(lambda self: audio._UNKNOWN_FRAMES))
        monkeypatch.setattr(audio, "_UNKNOWN_LENGTH_SECONDS", 0.1)
    loaded = audio.load_audio(data)
    assert loaded.dtype == np.float32 and loaded.shape == whole.shape
    assert np.max(np.abs(loaded - whole)) <= HQ_PRECISION


def test_load_audio_across_blocks_against_an_analytic_sine():
    """An oracle independent of soxr: a 440 Hz sine at 44.1 kHz over several decode blocks is, at 16 kHz, the
    same sine sampled at 16 kHz, everywhere but the filter's edges (no sample lost or repeated at a block
    boundary)."""
    rate = 44100
    seconds = 3.5 * audio._DECODE_BLOCK_FRAMES / rate
    loaded = audio.load_audio(_flac(sine(440, rate, seconds), rate))
    expected = sine(440, audio.SAMPLING_RATE, seconds)
    assert abs(loaded.size - expected.size) <= 1
    middle = slice(400, min(loaded.size, expected.size) - 400)
    np.testing.assert_allclose(loaded[middle], expected[middle], atol=2e-3)


def test_load_audio_keeps_only_16k_samples():
    """load_audio kept every decoded block at the file's rate and resampled at the end: a 96 kHz file held six
    times its 16 kHz samples (2 h: 2.8 GB of float32 before 460 MB), twice over once concatenated. Its peak of
    traced allocations (numpy reports its buffers to tracemalloc) is now the 16 kHz output plus a few blocks of
    decoding work, less than the native-rate signal alone."""
    import tracemalloc

    rate, seconds = 96000, 60
    data = _flac(np.random.default_rng(0).uniform(-0.5, 0.5, rate * seconds).astype(np.float32), rate)
    native_bytes = rate * seconds * 4  # float32 mono at 96 kHz: what the old code held before resampling
    tracemalloc.start()
    try:
        loaded = audio.load_audio(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert loaded.size == audio.SAMPLING_RATE * seconds
    # Decoding work, a few blocks' worth (measured: 1.1 MB): the block read, soxr's piece, the file's reads.
    work = 8 * audio._DECODE_BLOCK_FRAMES * 4
    assert peak <= loaded.nbytes + work < native_bytes, (peak, loaded.nbytes, native_bytes)
