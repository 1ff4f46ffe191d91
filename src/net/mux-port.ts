/**
 * What a frame multiplexer's two halves — the bridge (mux-bridge.ts, the
 * far side's requests) and the caller (mux-caller.ts, ours) — share of it
 * (frame-mux.ts): a module of its own, so neither half imports the mux
 * that holds them.
 */
import type { RelayLogEntry } from './contract.ts';
import type { MuxOptions } from './relay-options.ts';
import type { SendGate } from './socket.ts';

/** What the bridge and the caller share of their mux. */
export interface MuxPort {
  readonly options: MuxOptions;
  readonly gate: SendGate;
  readonly closed: boolean;
  /** Send on the socket; never throws: a lost answer is logged (the far side answers its caller 502). */
  send(data: string | Uint8Array, streamId?: number, requestId?: string): Promise<void> | void;
  log(entry: RelayLogEntry): void;
  /** Make sure a sweep runs by `deadline` (give or take frame-mux.ts's SWEEP_SLACK_MS). */
  armSweep(deadline: number): void;
  /** Nothing pending: drop the timer, so an idle connection holds none (and keeps no process alive). */
  maybeDisarmSweep(): void;
}
