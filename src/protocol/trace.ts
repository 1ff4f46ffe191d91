/**
 * A per-step timeline across processes (where a hop's fixed cost goes:
 * docs/architecture.md). Off unless a host installs a sink (`MESHNET_TRACE=path` in the
 * Node.js CLI: src/cli/trace-file.ts); then the data path stamps each stage
 * of a step — frame received, handler start, span start/end, push sent,
 * token received, NDJSON written — with the time and the step's session and
 * position, and bench/hop-trace.ts lines the stamps of every process up.
 *
 * Zero cost when off: every call site is `trace?.(…)` on this live binding,
 * one load and a compare, and builds nothing unless a sink is set.
 */

/** One stamp: `stage` names the point in the data path; session and position name the step when known there. */
export type TraceStamp = (stage: string, session?: string, position?: string | number) => void;

/** The installed sink; undefined (the default) turns every stamp off. */
export let trace: TraceStamp | undefined;

/** Install (or with undefined remove) the sink. */
export function setTrace(sink: TraceStamp | undefined): void {
  trace = sink;
}
