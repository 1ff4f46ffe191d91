/**
 * The node's one state machine, the same on every host: what the donor page
 * shows as a badge, what a Node.js node logs.
 *
 *   idle ─start─▶ connecting ─▶ downloading ─▶ loading ─▶ serving ⇄ paused
 *                    ▲   ▲                                  │
 *                    │   └──────── relay lost / back ───────┘
 *                    └──────────── retry ◀── error (any load step fails, when the host stops on failure)
 *
 * While a new span loads beside the one that serves (the tracker moved the
 * node), the state shows the load (downloading, loading); the old span keeps
 * answering until the new one is switched in.
 */
export const NodeState = {
  /** Not started: no span to serve yet. */
  Idle: 'idle',
  /** Opening storage, reaching the relay and the tracker, or waiting for an assignment. */
  Connecting: 'connecting',
  /** Fetching the span's weights. */
  Downloading: 'downloading',
  /** Choosing the backend and building the span's graphs. */
  Loading: 'loading',
  /** A span is in and requests are answered (over the relay when there is one). */
  Serving: 'serving',
  /** The donor paused: /forward answers 503, weights stay. */
  Paused: 'paused',
  /** Stopped with a reason; a retry starts over. */
  Error: 'error',
} as const;
export type NodeState = (typeof NodeState)[keyof typeof NodeState];


/** What the state is derived from: one function of these facts, so no event can leave it stale. */
export interface StateFacts {
  started: boolean;
  failed: boolean;
  /** A load in progress, and how far. */
  loading: 'downloading' | 'loading' | undefined;
  hasSpan: boolean;
  /** Undefined: no relay (a Node.js node on direct HTTP only). */
  relayRegistered: boolean | undefined;
  paused: boolean;
}

export function deriveState(f: StateFacts): NodeState {
  if (!f.started) return NodeState.Idle;
  if (f.failed) return NodeState.Error;
  if (f.loading) return f.loading === 'downloading' ? NodeState.Downloading : NodeState.Loading;
  if (!f.hasSpan || f.relayRegistered === false) return NodeState.Connecting;
  return f.paused ? NodeState.Paused : NodeState.Serving;
}
