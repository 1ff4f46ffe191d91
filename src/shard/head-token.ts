/**
 * The token of a fused head run (its outputs still where the backend left
 * them): greedy from the head graph's ArgMax (12 bytes down), temperature > 0
 * from the sampler graph's candidates (device-sampler.ts) or over the
 * downloaded logits, whichever sampler-choice.ts measured faster here; CPU
 * backends (or `returnLogits`) sample over the logits they hold anyway.
 */
import { HEAD_IO } from '../model/fused-graph.ts';
import { hostData, type BackendSessionOptions, type BackendTensor, type OnnxBackend, type RunValue } from './backend.ts';
import { DeviceSampler, type DeviceSamplingStats } from './device-sampler.ts';
import type { ForwardResult } from './contract.ts';
import { SamplerPathChooser, type SamplerChoice, type SamplerPathStats } from './sampler-choice.ts';
import { sampleToken, validateSampling, type SamplingParams } from './sampling.ts';

export class HeadTokenPicker {
  private readonly sampler: DeviceSampler | null;
  private readonly path: SamplerPathChooser;

  /** `candidates` 0: no sampler graph (temperature > 0 always downloads the logits). */
  constructor(backend: OnnxBackend, vocabSize: number, candidates: number, choice: SamplerChoice, sessionOptions: BackendSessionOptions) {
    this.sampler = candidates > 0 ? new DeviceSampler(backend, vocabSize, candidates, sessionOptions) : null;
    this.path = new SamplerPathChooser(choice);
  }

  /** The token at `position` from the head's outputs; `logits` is empty unless they were downloaded. */
  async pick(out: Record<string, RunValue>, sampling: SamplingParams, position: number, returnLogits: boolean): Promise<Extract<ForwardResult, { kind: 'token' }>> {
    validateSampling(sampling);
    if (!returnLogits && !((sampling.temperature ?? 0) > 0)) {
      // Greedy: the head graph's ArgMax chose on the device; 12 bytes came back.
      const tokenId = Number((out[HEAD_IO.greedyToken] as BackendTensor).data[0]);
      const logprob = (out[HEAD_IO.greedyLogprob] as BackendTensor).data[0] as number;
      return { kind: 'token', tokenId, logprob, logits: new Float32Array(0) };
    }
    const onDevice = out[HEAD_IO.logits]!;
    const timed = !returnLogits && this.sampler !== null;
    const path = timed ? this.path.next() : 'logits';
    const t0 = performance.now();
    if (timed && path === 'candidates') {
      // Temperature > 0: the token from the top candidates (~3 KiB), or null and the logits below.
      const picked = await this.sampler!.sample(onDevice, sampling, position);
      if (picked) {
        this.path.record('candidates', performance.now() - t0);
        return { kind: 'token', ...picked, logits: new Float32Array(0) };
      }
    }
    const logits = (await hostData(onDevice)) as Float32Array;
    const { tokenId, logprob } = sampleToken(logits, sampling, position);
    if (timed) this.path.record(path, performance.now() - t0);
    return { kind: 'token', tokenId, logprob, logits };
  }

  stats(): DeviceSamplingStats & { path: SamplerPathStats } {
    return { ...(this.sampler?.stats() ?? { onDevice: 0, fallbacks: 0, reasons: {} }), path: this.path.stats() };
  }

  async release(): Promise<void> {
    await this.sampler?.release();
  }
}
