// AudioWorklet processor "pcm16-capture": microphone audio at the context's rate in, 80 ms chunks of
// 16 kHz mono PCM16 out (the /v1/realtime wire format), each posted with its peak level for a meter.
// Shared by the demo page and the Colab notebook, which loads this same file as a Blob module.
const TARGET_RATE = 16000;
const CHUNK = 1280; // 80 ms at 16 kHz: one model step, so every message feeds the engine one slot

class Pcm16Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    // Input samples per output sample: 1 when the page got a 16 kHz context (the browser resampled),
    // 3 at 48 kHz, 2.75625 at 44.1 kHz.
    this.step = sampleRate / TARGET_RATE;
    this.phase = 0; // input samples taken into the current output sample
    this.sum = 0;
    this.count = 0;
    this.chunk = new Int16Array(CHUNK);
    this.filled = 0;
    this.peak = 0;
  }

  process(inputs) {
    const channels = inputs[0];
    if (channels && channels.length > 0) {
      const frames = channels[0].length;
      for (let i = 0; i < frames; i++) {
        let x = 0;
        for (const channel of channels) x += channel[i];
        // Each output sample is the mean of its span of input samples: a box filter, an add per sample. It
        // damps what folds back into the 0-8 kHz band only a little (at 48 kHz a 10 kHz tone comes out at
        // 6 kHz just 6 dB down); speech carries little energy above 8 kHz, so that little is enough.
        this.sum += x / channels.length;
        this.count += 1;
        this.phase += 1;
        if (this.phase >= this.step) {
          this.phase -= this.step;
          this.emit(this.sum / this.count);
          this.sum = 0;
          this.count = 0;
        }
      }
    }
    return true; // keep running while the input is silent or momentarily absent
  }

  emit(x) {
    const clipped = Math.max(-1, Math.min(1, x));
    this.peak = Math.max(this.peak, Math.abs(clipped));
    this.chunk[this.filled++] = Math.round(clipped * 32767);
    if (this.filled === CHUNK) {
      // Transfer the buffer (no copy) and start a fresh one.
      this.port.postMessage({ pcm: this.chunk.buffer, peak: this.peak }, [this.chunk.buffer]);
      this.chunk = new Int16Array(CHUNK);
      this.filled = 0;
      this.peak = 0;
    }
  }
}

registerProcessor("pcm16-capture", Pcm16Capture);
