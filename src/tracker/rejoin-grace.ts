/**
 * What the tracker remembers of nodes it removed: who was dropped (one that
 * comes back was away, not re-registering after a tracker restart, so the
 * span it still serves is not simply adopted), and the spans of nodes
 * dropped for silence until their rejoin grace ends. A closed tab reopened,
 * a laptop woken, comes back with its span and no download, so no serving
 * node is moved onto those layers meanwhile (new and idle nodes still take
 * them). Only moves see these spans (docs/architecture.md, rejoin grace).
 */
import type { Coverage, Span } from './assignment.ts';

/** A span held from moves while its node may come back. */
export interface AbsentSpan {
  span: Span;
  throughput: number;
}

interface Vacated extends AbsentSpan {
  model: string;
  until: number;
}

/** Peers remembered as dropped, and spans held (bounded: the oldest go first). */
const REMEMBERED = 10_000;

export class RejoinGrace {
  private readonly dropped = new Set<string>();
  /** Spans of nodes dropped for silence, by peer id, until their grace ends. */
  private readonly vacated = new Map<string, Vacated>();
  /** Per model, when the next rejoin grace ends (a rebalance is due then). */
  private readonly graceEnds = new Map<string, number>();

  wasDropped(peerId: string): boolean {
    return this.dropped.has(peerId);
  }

  noteDropped(peerId: string): void {
    this.dropped.delete(peerId);
    this.dropped.add(peerId);
    // A Set iterates in insertion order.
    if (this.dropped.size > REMEMBERED) this.dropped.delete(this.dropped.values().next().value!);
  }

  /** The node registered here again: neither dropped nor absent any more. */
  back(peerId: string): void {
    this.dropped.delete(peerId);
    this.vacated.delete(peerId);
  }

  noteVacated(peerId: string, v: Vacated): void {
    this.vacated.delete(peerId);
    this.vacated.set(peerId, v);
    if (this.vacated.size > REMEMBERED) this.vacated.delete(this.vacated.keys().next().value!);
  }

  /** Its span is no longer held (it is alive again, or its grace is moot). */
  endVacated(peerId: string): void {
    this.vacated.delete(peerId);
  }

  /** When the rejoin grace of a node dropped for silence ends (ms since epoch); undefined: it has none at `now`. */
  vacatedUntil(peerId: string, now: number): number | undefined {
    const v = this.vacated.get(peerId);
    return v !== undefined && v.until > now ? v.until : undefined;
  }

  /** When the next rejoin grace of `model` ends, as the last {@link absent} noted (Infinity: none). */
  nextEnd(model: string): number {
    return this.graceEnds.get(model) ?? Infinity;
  }

  /**
   * The spans moves judge as still held in a model of `numLayers` layers: those of nodes dropped for silence in
   * their grace, and `draining` (the registry's own, with when each grace ends). Notes when the next grace
   * ends; forgets the ended. Undefined: none.
   */
  absent(model: string, numLayers: number, now: number, draining: ReadonlyArray<AbsentSpan & { until: number }>): Coverage | undefined {
    const extra: AbsentSpan[] = [];
    let next = Infinity;
    for (const [id, v] of this.vacated) {
      if (v.model !== model) continue;
      if (v.until <= now) {
        this.vacated.delete(id);
        continue;
      }
      extra.push(v);
      next = Math.min(next, v.until);
    }
    for (const d of draining) {
      extra.push(d);
      next = Math.min(next, d.until);
    }
    if (next === Infinity) this.graceEnds.delete(model);
    else this.graceEnds.set(model, next);
    if (extra.length === 0) return undefined;
    const absent: Coverage = { count: new Array<number>(numLayers).fill(0), throughput: new Array<number>(numLayers).fill(0) };
    for (const x of extra) {
      for (let l = Math.max(0, x.span.start); l < Math.min(numLayers, x.span.end); l++) {
        absent.count[l]!++;
        absent.throughput[l]! += x.throughput;
      }
    }
    return absent;
  }
}
