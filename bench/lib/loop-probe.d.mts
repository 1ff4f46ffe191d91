export interface LoopProbe {
  /** Start the measured window afresh. */
  reset(): void;
  /** Write the probe file now. */
  write(): void;
}
/** Probe this process's event loop into `outDir` (undefined when no directory is given). */
export function startLoopProbe(role?: string, outDir?: string): LoopProbe | undefined;
