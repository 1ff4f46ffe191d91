/**
 * Screenshots the docs link to are refreshed on purpose, not by every test
 * run: `MESHNET_UPDATE_DOCS=1 npx playwright test` writes them into docs/,
 * otherwise they land in test-results/ and the working tree stays clean.
 */
export function screenshotPath(name: string): string {
  return process.env.MESHNET_UPDATE_DOCS === '1' ? `docs/${name}` : `test-results/${name}`;
}
