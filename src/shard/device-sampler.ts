/**
 * Temperature > 0 on a device without bringing the logits back: runs the
 * sampler graph (src/model/sampler-graph.ts) on the head's logits where they
 * are and lets candidate-sampling.ts pick from its K candidates. When they
 * cannot prove the token sampling.ts would draw (a top_k past the
 * candidates, a draw or nucleus edge in the mass outside them or within the
 * normalizer's tolerance), `sample` answers null and the caller downloads
 * the logits for that step alone. Counts both, so a deployment can see how
 * often the fallback fires.
 */
import { buildSamplerGraph, DEFAULT_SAMPLER_CANDIDATES, SAMPLER_IO } from '../model/sampler-graph.ts';
import type { BackendSessionOptions, BackendTensor, OnnxBackend, OnnxSession, RunValue } from './backend.ts';
import { sampleFromCandidates, type Candidates } from './candidate-sampling.ts';
import type { Sampled, SamplingParams } from './sampling.ts';

export interface DeviceSamplingStats {
  /** Steps decided from the candidates. */
  onDevice: number;
  /** Steps that downloaded the logits, by reason. */
  fallbacks: number;
  reasons: Record<string, number>;
}

export class DeviceSampler {
  private session: Promise<OnnxSession> | null = null;
  private broken: string | null = null;
  private readonly counts: DeviceSamplingStats = { onDevice: 0, fallbacks: 0, reasons: {} };

  constructor(
    private readonly backend: OnnxBackend,
    private readonly vocabSize: number,
    private readonly candidateCount = DEFAULT_SAMPLER_CANDIDATES,
    private readonly sessionOptions: BackendSessionOptions = {},
  ) {}

  /** The token for a [1, vocab] row of logits at temperature > 0, or null: then use sampleToken over the downloaded logits. */
  async sample(logits: RunValue, params: SamplingParams, position: number): Promise<Sampled | null> {
    const c = await this.candidates(logits, params.temperature ?? 0);
    if (typeof c === 'string') return this.fellBack(c);
    const got = sampleFromCandidates(c, params, position);
    if ('fallback' in got) return this.fellBack(got.fallback);
    this.counts.onDevice++;
    return got.sampled;
  }

  /**
   * What the sampler graph sends back for a [1, vocab] row at `temperature`
   * (it does not depend on seed, top_k or top_p), or why there is none.
   */
  async candidates(logits: RunValue, temperature: number): Promise<Candidates | string> {
    const session = await this.open();
    if (!session) return `no sampler graph: ${this.broken}`;
    let out: Record<string, RunValue>;
    try {
      out = await session.runWith({
        [SAMPLER_IO.logits]: logits,
        [SAMPLER_IO.temperature]: { type: 'float32', data: Float32Array.of(temperature), dims: [1, 1] },
      });
    } catch (e) {
      // The logits are still there: this step samples over them instead of failing the request.
      return `the sampler graph failed: ${e instanceof Error ? e.message : String(e)}`;
    }
    const host = (name: string) => (out[name] as BackendTensor).data;
    return {
      values: host(SAMPLER_IO.values) as Float32Array,
      ids: host(SAMPLER_IO.ids) as BigInt64Array,
      logSumExpT: host(SAMPLER_IO.logSumExpT)[0] as number,
      logSumExp: host(SAMPLER_IO.logSumExp)[0] as number,
      vocabSize: this.vocabSize,
    };
  }

  stats(): DeviceSamplingStats {
    return { ...this.counts, reasons: { ...this.counts.reasons } };
  }

  async release(): Promise<void> {
    const s = await this.session?.catch(() => null);
    await s?.release();
  }

  /** Built on first use (a greedy-only node never pays for it); a backend that cannot run it samples over downloaded logits. */
  private async open(): Promise<OnnxSession | null> {
    if (this.broken !== null) return null;
    // The sampler's outputs are small: they come to the host (no deviceOutputs).
    this.session ??= this.backend.createSession(buildSamplerGraph(this.vocabSize, this.candidateCount).bytes, { ...this.sessionOptions, deviceOutputs: [] });
    try {
      return await this.session;
    } catch (e) {
      this.broken = e instanceof Error ? e.message : String(e);
      return null;
    }
  }

  private fellBack(reason: string): null {
    this.counts.fallbacks++;
    this.counts.reasons[reason] = (this.counts.reasons[reason] ?? 0) + 1;
    return null;
  }
}
