/**
 * How many tokens a generation drafts per trip, from what it measures.
 *
 * A trip with k drafted tokens yields E(α, k) = (1 − α^(k+1)) / (1 − α)
 * tokens on average (α: the chance a draft is accepted given its
 * predecessors were) and costs t(k) = base + k·perRow + k·draftCost: the
 * plain step's trip, each extra row through every hop, and drafting. The
 * policy picks the k in 0..maxK with the most tokens per ms, 0 being a plain
 * step (E = 1, t = base); it speculates only when that beats the plain step
 * by `margin` (so a poor drafter costs little), and while it does not it
 * drafts one token every `probeEvery` trips to keep α current (each probe
 * that changes nothing doubles that wait, up to 8×; a probe accepted while
 * α̂ is low sets it back).
 *
 * Estimates, discounted so they follow the text as it changes:
 * - α: accepted drafts / (accepted + rejections) — the maximum likelihood
 *   estimate for geometric acceptance (each trip's drafts are looked at
 *   until the first rejection), with a prior of a quarter accepted, one
 *   rejected.
 * - base and perRow: a ridge regression of trip time on drafted rows, the
 *   slope pulled towards `perRowPrior` × base until the rows vary enough to
 *   tell; every 4th speculating trip drafts one token fewer or more so they
 *   always do (near the best k the rate is flat: this costs little); never
 *   below 1% of the plain trip.
 * - draftCost: the drafter's own measured ms per proposed token.
 *
 * A hop that reports full batches turns speculation off for `fullHoldTrips`
 * trips: batching already amortises the trip, and drafts would only add rows.
 *
 * How a generation starts, with nothing carried: a free drafter (prompt
 * lookup, a prediction) drafts a moderate k = 4 at once (a wrong guess costs
 * only rows); a drafter that computes (a draft model new to this head:
 * `probeFirst`) drafts nothing until its catch-up has run beside the prompt's
 * step, then probes one token on the first decode trip, so a draft model
 * that disagrees costs a probe or two, not a few trips of k losing forwards.
 * The probe also measures the draft's cost. While every draft is accepted
 * the next trip drafts at least four times as many (1, 4, 16), but never
 * longer than a plain trip takes (a wrong guess costs at most one trip); the
 * first rejection leaves k to α̂ and the costs alone.
 *
 * What a generation learnt can start the next one (`carry()` → `prior`): a
 * draft model's α is a property of the pair of models more than of the text,
 * so a head whose draft model keeps losing starts its next generation at
 * k = 0, probing at the back-off it had reached, instead of paying a few
 * losing trips to find that out again. The carried evidence weighs at most
 * `CARRY_WEIGHT` trips, so a generation where the drafter does well still
 * turns it back on within a few probes.
 */

export interface AdaptiveKOptions {
  /** Largest k. @defaultValue 16 */
  maxK?: number;
  /** Always this k (benchmarks: the efficiency against theory at a chosen k). */
  fixedK?: number;
  /** Trips between one-token probes while speculation does not pay. @defaultValue 16 */
  probeEvery?: number;
  /** Plain trips after a hop reported full batches. @defaultValue 8 */
  fullHoldTrips?: number;
  /** Speculate only when the best k is expected to beat a plain step by this fraction. @defaultValue 0.03 */
  margin?: number;
  /** Cost of one more row per trip as a fraction of the plain trip, until measured. @defaultValue 0.05 */
  perRowPrior?: number;
  /** Weight of each trip's evidence against the newest (per trip). @defaultValue 0.95 */
  decay?: number;
  /** What earlier generations with the same drafter learnt (`carry()`); absent: a prior of a quarter accepted, one rejected. */
  prior?: CarriedPolicy;
  /**
   * Nothing carried: start with a one-token probe on the first decode trip instead of k = 4
   * (a drafter whose cost and acceptance are unknown, such as a draft model new to this head).
   * Ignored with a `prior` (it says what to do) or a fixed k.
   */
  probeFirst?: boolean;
}

export interface TripRecord {
  /** Tokens drafted and sent (0: a plain step). */
  drafted: number;
  /** Of those, accepted. */
  accepted: number;
  /** From the step's start at the head to its tokens, ms (NaN: not a decode trip's time, e.g. the prompt's step: only its drafts count). */
  tripMs: number;
}

/** A policy's state worth keeping between generations (see `AdaptiveK.carry`). */
export interface CarriedPolicy {
  /** Discounted accepted drafts and rejecting trips. */
  accepted: number;
  rejected: number;
  /** Discounted regression sums of trip ms on drafted rows. */
  sums: { s0: number; sx: number; sy: number; sxx: number; sxy: number };
  /** The drafter's ms per proposed token (0: not measured). */
  draftMs: number;
  /** Probe back-off: trips between probes now, and plain trips since the last draft (absent: a fixed k, which never probes). */
  probe?: { wait: number; since: number };
}

/** Carried acceptance counts weigh at most this many trips' worth in the next generation. */
export const CARRY_WEIGHT = 8;
/** Carried trip-time sums weigh at most this many trips. */
const CARRY_COST_WEIGHT = 4;

export interface AdaptiveKStats {
  alpha: number;
  baseMs: number;
  perRowMs: number;
  draftMsPerToken: number;
  k: number;
}

/** Expected tokens per trip with k drafts at acceptance α. */
export function expectedTokens(alpha: number, k: number): number {
  if (k <= 0) return 1;
  if (alpha >= 1) return k + 1;
  return (1 - alpha ** (k + 1)) / (1 - alpha);
}

export class AdaptiveK {
  private readonly maxK: number;
  private readonly fixedK: number | undefined;
  private readonly probeEvery: number;
  private readonly fullHoldTrips: number;
  private readonly margin: number;
  private readonly perRowPrior: number;
  private readonly decay: number;
  // A prior of a quarter accepted, one rejected: a first trip's evidence outweighs it either way (a good
  // drafter's first trip accepts several), and a useless drafter is found out within a few trips.
  private accepted = 0.25;
  private rejected = 1;
  // Discounted regression sums of trip ms on drafted rows.
  private s0 = 0;
  private sx = 0;
  private sy = 0;
  private sxx = 0;
  private sxy = 0;
  private trips = 0;
  private sinceSpeculated = 0;
  private heldUntil = 0;
  private draftMs = 0;
  private lastK = 0;
  private probeWait: number;
  /** Nothing measured yet: probe (true) or draft the moderate k = 4. */
  private readonly probeFirst: boolean;
  /** After a probe-first start, until the first rejected draft: the least k of the next speculating trip (0: none yet; −1: over). */
  private ramp = 0;

  constructor(o: AdaptiveKOptions = {}) {
    this.maxK = o.maxK ?? 16;
    if (!(Number.isInteger(this.maxK) && this.maxK >= 1 && this.maxK <= 16)) throw new RangeError(`max k ${this.maxK} is not in 1..16`);
    if (o.fixedK !== undefined && !(Number.isInteger(o.fixedK) && o.fixedK >= 0 && o.fixedK <= 16)) throw new RangeError(`k ${o.fixedK} is not in 0..16`);
    this.fixedK = o.fixedK;
    this.probeEvery = o.probeEvery ?? 16;
    this.probeWait = this.probeEvery;
    this.fullHoldTrips = o.fullHoldTrips ?? 8;
    this.margin = o.margin ?? 0.03;
    this.perRowPrior = o.perRowPrior ?? 0.05;
    this.decay = o.decay ?? 0.95;
    this.probeFirst = o.prior === undefined && o.fixedK === undefined && o.probeFirst === true;
    // The first decode trip probes: the step before it (the prompt's) is the one that lets the drafter catch up.
    if (this.probeFirst) this.sinceSpeculated = this.probeWait - 1;
    if (o.prior) this.start(o.prior);
  }

  private start(p: CarriedPolicy): void {
    const total = p.accepted + p.rejected;
    if (Number.isFinite(total) && total > 0 && p.accepted >= 0 && p.rejected >= 0) {
      const w = Math.min(1, CARRY_WEIGHT / total);
      this.accepted = p.accepted * w;
      this.rejected = p.rejected * w;
    }
    const s = p.sums;
    if ([s.s0, s.sx, s.sy, s.sxx, s.sxy].every(Number.isFinite) && s.s0 > 0) {
      const w = Math.min(1, CARRY_COST_WEIGHT / s.s0);
      this.s0 = s.s0 * w;
      this.sx = s.sx * w;
      this.sy = s.sy * w;
      this.sxx = s.sxx * w;
      this.sxy = s.sxy * w;
    }
    if (Number.isFinite(p.draftMs) && p.draftMs > 0) this.draftMs = p.draftMs;
    if (p.probe && Number.isInteger(p.probe.wait) && p.probe.wait >= this.probeEvery && Number.isInteger(p.probe.since) && p.probe.since >= 0) {
      this.probeWait = Math.min(8 * this.probeEvery, p.probe.wait);
      this.sinceSpeculated = p.probe.since;
    }
  }

  /** This generation's evidence, to start the next one with the same drafter (`prior`). */
  carry(): CarriedPolicy {
    const c: CarriedPolicy = {
      accepted: this.accepted,
      rejected: this.rejected,
      sums: { s0: this.s0, sx: this.sx, sy: this.sy, sxx: this.sxx, sxy: this.sxy },
      draftMs: this.draftMs,
    };
    if (this.fixedK === undefined) c.probe = { wait: this.probeWait, since: this.sinceSpeculated };
    return c;
  }

  /**
   * Whether the trip after the one just planned is due to draft while
   * drafting does not pay (a probe): a drafter with state to catch up (a
   * draft model) can do that while this trip is in flight.
   */
  probeComesNext(): boolean {
    return this.fixedK === undefined && this.lastK === 0 && this.trips >= this.heldUntil && this.sinceSpeculated + 1 >= this.probeWait;
  }

  get alpha(): number {
    return this.accepted / (this.accepted + this.rejected);
  }

  /** The drafter's measured cost per proposed token, ms. */
  setDraftCost(ms: number): void {
    // 0 is "not measured yet" (a fresh draft model): keep what was carried.
    if (Number.isFinite(ms) && ms > 0) this.draftMs = ms;
  }

  /** A hop's batches are full: plain steps for a while. */
  batchFull(): void {
    this.heldUntil = this.trips + this.fullHoldTrips;
  }

  /** The plain step's time and the cost of one more row, as estimated now. */
  costs(): { baseMs: number; perRowMs: number } {
    if (this.s0 === 0) return { baseMs: 0, perRowMs: 0 };
    const mx = this.sx / this.s0;
    const my = this.sy / this.s0;
    const cxx = this.sxx - this.s0 * mx * mx;
    const cxy = this.sxy - this.s0 * mx * my;
    // Ridge towards the prior slope: λ pseudo-trips' worth of spread (one row apart) at that slope.
    const lambda = 1;
    const prior = (this.perRowPrior * my) / (1 + this.perRowPrior * mx);
    const slope = Math.max(0, (cxy + lambda * prior) / (Math.max(0, cxx) + lambda));
    // A row is never free (every hop computes it): at least 1% of a plain trip, whatever noisy trip times say.
    const base = Math.max(1e-3, my - slope * mx);
    return { baseMs: base, perRowMs: Math.max(slope, 0.01 * base) };
  }

  /** k for the next trip (0: a plain step). */
  next(): number {
    if (this.fixedK !== undefined) return (this.lastK = this.fixedK);
    if (this.trips < this.heldUntil) return (this.lastK = 0);
    // Nothing timed yet: a moderate start, or (a drafter that computes) a probe as soon as it is due.
    if (this.s0 === 0 && !this.probeFirst) return (this.lastK = Math.min(4, this.maxK));
    let best = 0;
    if (this.s0 > 0) {
      const a = this.alpha;
      const { baseMs, perRowMs } = this.costs();
      // The ramp's k drafts no longer than a plain trip takes: a wrong guess costs at most one trip.
      const ramp = Math.min(this.ramp, Math.floor(baseMs / (perRowMs + this.draftMs)));
      let bestRate = 1 / baseMs;
      for (let k = 1; k <= this.maxK; k++) {
        const rate = expectedTokens(a, k) / (baseMs + k * (perRowMs + this.draftMs));
        if (rate > bestRate) {
          best = k;
          bestRate = rate;
        }
      }
      if (best > 0 && bestRate < (1 + this.margin) / baseMs) best = 0;
      if (best > 0 && ramp > best) best = Math.min(this.maxK, ramp);
    }
    if (best === 0) {
      // Probe: each one that still finds speculation not paying doubles the wait for the next (to 8×).
      if (this.sinceSpeculated < this.probeWait) return (this.lastK = 0);
      this.probeWait = Math.min(8 * this.probeEvery, this.probeWait * 2);
      return (this.lastK = 1);
    }
    this.probeWait = this.probeEvery;
    // Every 4th trip one row fewer or more (alternately): the rows must vary for the per-row cost
    // to be measured at all, and near the best k the rate is flat, so this costs little.
    if (this.trips % 4 === 3 && this.ramp <= 0) best = Math.max(0, Math.min(this.maxK, best + ((this.trips >> 2) % 2 === 0 ? -1 : 1)));
    return (this.lastK = best);
  }

  record(t: TripRecord): void {
    this.trips++;
    const g = this.decay;
    if (t.drafted > 0) {
      // A probe accepted where α̂ said it would almost surely fail: the estimate is stale (the text or,
      // after a carried prior, the task changed), so look again soon, whatever the back-off had reached.
      if (t.accepted === t.drafted && this.alpha < 0.25) this.probeWait = this.probeEvery;
      // A probe-first start ramps up while every draft is accepted (1, 4, 16 within what a plain trip's time pays
      // for: α̂ alone, on a few trips' noisy costs, grows k more slowly than a good draft model deserves); the
      // first rejection hands k to α̂ alone.
      if (this.probeFirst && this.ramp >= 0) this.ramp = t.accepted === t.drafted ? 4 * t.drafted : -1;
      this.sinceSpeculated = 0;
      this.accepted = this.accepted * g + t.accepted;
      this.rejected = this.rejected * g + (t.accepted < t.drafted ? 1 : 0);
    } else this.sinceSpeculated++;
    if (Number.isFinite(t.tripMs) && t.tripMs >= 0) {
      const x = t.drafted;
      const y = t.tripMs;
      this.s0 = this.s0 * g + 1;
      this.sx = this.sx * g + x;
      this.sy = this.sy * g + y;
      this.sxx = this.sxx * g + x * x;
      this.sxy = this.sxy * g + x * y;
    }
  }

  stats(): AdaptiveKStats {
    const { baseMs, perRowMs } = this.costs();
    return { alpha: this.alpha, baseMs, perRowMs, draftMsPerToken: this.draftMs, k: this.lastK };
  }
}
