/** Defaults of `meshnet demo` (src/cli/demo.ts), apart from it so `--help` loads nothing else. */
export const DEMO_DEFAULTS = {
  nodes: 3,
  /** MiB per page when --budget is not given, raised to what covers the model with the pages asked for: 60 gives each of 3 pages a third of `small` (4 layers), so a chat crosses all three. */
  budgetMb: 60,
  preset: 'small',
  prompt: 'Tell me a short story about a fox who shares her GPU.',
  maxTokens: 48,
  exitAfterChat: false,
} as const;
