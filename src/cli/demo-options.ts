/** Defaults of `meshnet demo` (src/cli/demo.ts), apart from it so `--help` loads nothing else. */

/** The demo's models: the shipped one first (models/fortunes-tiny), then generated fixture presets (src/model/fixture.ts). */
export const DEMO_MODELS = ['fortunes-tiny', 'small', 'tiny'] as const;
export type DemoModel = (typeof DEMO_MODELS)[number];

export function isDemoModel(name: string): name is DemoModel {
  return (DEMO_MODELS as readonly string[]).includes(name);
}

export const DEMO_DEFAULTS = {
  nodes: 3,
  /**
   * The model: `fortunes-tiny` (shipped in models/, learned weights, so the
   * answer is English), or a generated fixture preset (small, tiny: random weights).
   */
  preset: 'fortunes-tiny',
  prompt: 'Tell me a fortune about science.',
  maxTokens: 48,
  exitAfterChat: false,
} as const;
